"""Development tools of openkernels: the `openkernels` command, benchmark helpers, test utilities.

Nothing the runtime imports lives here (a test checks that importing a family leaves this
package unloaded). Users of the kernels never need it; contributors, CI and the benchmark
scripts do:

- `cli`: the `openkernels` command (`python -m openkernels.shared` runs it too).
- `bench`, `bench_jax`: benchmark cases, timing and peers.
- `testing`: tolerances, inputs, opcheck helpers, the ahead-of-time compile check, the opt-in
  pytest plugin.
- `model_demo`: `openkernels demo`.
"""
