"""Launch-config sweeps whose winners go into the families' triton/configs.py tables."""
