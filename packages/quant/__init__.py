"""Makes pytest import this family's tests as `quant.tests.*`: every family has a `tests`
package, and under --import-mode=importlib two top-level `tests` packages collide (the
second family's modules would silently be the first's). Not part of any wheel."""
