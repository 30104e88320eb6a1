"""The demo (the README's main job) drives every installed family through the same calls:
those calls must work for each family, whatever its own benchmark directions are."""

from __future__ import annotations

import importlib

import pytest

from openkernels.shared import demo


@pytest.mark.parametrize("family", demo.families())
def test_demo_builds_every_family_cases(family: str) -> None:
    bench = importlib.import_module(f"openkernels.{family}.bench")
    cases = bench.cases("cpu", peers=("torch",))  # the demo's call
    assert cases, f"{family}: no benchmark cases on CPU"
    for case in cases:
        assert case.bytes > 0 and "ours" in case.contenders and "torch" in case.contenders
    assert callable(bench.checks)
