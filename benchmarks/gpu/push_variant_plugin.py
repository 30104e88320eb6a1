"""pytest plugin: run the layernorm tests against a study build of the pushed forward.

    PUSH_VARIANT_UNDER_TEST=sp PYTHONPATH=benchmarks/gpu:$PYTHONPATH \
        python -m pytest -p push_variant_plugin packages/layernorm/tests/test_cluster.py -k push

Every call that would run the default build (cuda._push_library) runs
cuda.push_variant_library(PUSH_VARIANT_UNDER_TEST) instead, so a build can be checked on the
GPU (or under the emulation) before it becomes the default."""

from __future__ import annotations

import os


def pytest_configure(config: object) -> None:
    variant = os.environ.get("PUSH_VARIANT_UNDER_TEST")
    if variant:
        from openkernels.layernorm import cuda as C

        C._push_library = C.push_variant_library(variant)
        print(f"push_variant_plugin: the pushed forward runs the {variant!r} build")
