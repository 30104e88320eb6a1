"""Testing utilities shared by every family: tolerances, inputs, comparison, op checks.

The ahead-of-time compile checker lives in `openkernels.shared.dev.testing.aot`; the pytest
plugin (markers, strict dispatch, fixtures) in `openkernels.shared.dev.testing.plugin`.
"""

from .compare import TOLERANCES, Tolerance, assert_close, tolerance
from .inputs import ODD_SIZES, noncontiguous_views, poisoned_empty, random_tensor
from .ops import failing_implementation, run_opcheck, targets, testable_implementations

__all__ = [
    "ODD_SIZES",
    "TOLERANCES",
    "Tolerance",
    "assert_close",
    "failing_implementation",
    "noncontiguous_views",
    "poisoned_empty",
    "random_tensor",
    "run_opcheck",
    "targets",
    "testable_implementations",
    "tolerance",
]
