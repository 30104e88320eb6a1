"""The lent GPU machine's session scripts and quick correctness sweeps on the device."""
