"""bench.py follows the op table: its variants are spec.SPECS', its torch peers compute the
reference's values, and the asv suite times the same variants."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn.functional as F

from openkernels.activations import bench
from openkernels.shared.dev.testing import assert_close, random_tensor

from .cases import VARIANTS, Variant

ASV_SUITE = Path(__file__).resolve().parents[3] / "benchmarks" / "asv_suite" / "activations.py"


def _label(op: str, approximate: str | None) -> str:
    return f"{op}[{approximate}]" if approximate else op


def test_variants_are_the_table() -> None:
    assert [Variant(op, a).id for op, a in bench.VARIANTS] == [v.id for v in VARIANTS]


def test_torch_peers_compute_the_reference() -> None:
    x = random_tensor((6, 2 * 19), torch.float64, scale=3.0)
    for op, approximate in bench.VARIANTS:
        v = Variant(op, approximate)
        assert_close(bench.torch_composition(op, approximate)(x), v.ref(x), dtype=torch.float64, msg=v.id)


def test_an_op_with_a_torch_function_is_timed_against_it() -> None:
    assert bench.torch_composition("glu", None) is F.glu  # OpSpec.torch_peer
    assert bench.torch_composition("silu", None) is F.silu  # bench._TORCH_ACTS


def test_the_asv_suite_times_every_variant() -> None:
    # The asv suite lists its parameters as literals (asv runs today's suite on past commits,
    # so they cannot come from the installed package): a new op is added there too.
    tree = ast.parse(ASV_SUITE.read_text())
    (listed,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "VARIANTS" for t in node.targets)
    ]
    assert listed == [_label(op, a) for op, a in bench.VARIANTS]
