"""The rotary position embedding of q and k (apply_rotary): its PyTorch face (api.py), ops,
reference, Triton and CPU kernels, JAX face (jax/) and benchmark cases (bench.py)."""
