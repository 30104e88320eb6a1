"""Benchmarks against the peers: a family's cases, host time, decode, 4-bit linear, end to end, JAX."""
