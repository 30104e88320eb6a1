"""openkernels.shared: dispatch, platform detection, testing and benchmark helpers."""

__version__ = "0.5.0"
