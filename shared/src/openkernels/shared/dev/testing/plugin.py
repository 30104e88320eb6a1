"""pytest plugin of openkernels, opt-in: `-p openkernels.shared.dev.testing.plugin` (the repository's
pytest configuration passes it; installing openkernels-shared registers nothing with pytest).

Markers:
  interpreter  Triton kernels on CPU tensors; runs only with TRITON_INTERPRET=1.
  aot          ahead-of-time compile checks; skipped under TRITON_INTERPRET or without triton.
  gpu          needs a CUDA or ROCm device.
  slow         large inputs (over 2^31 elements); skipped when memory is short.
The test run sets OPENKERNELS_STRICT=1 so a failing kernel fails its test instead of
falling back to another implementation.
"""

from __future__ import annotations

import os

import pytest
import torch

from ...platform import triton_available, triton_interpreting

_MARKERS = {
    "interpreter": "Triton kernels under TRITON_INTERPRET=1 on CPU tensors",
    "aot": "ahead-of-time compile checks for sm_80, sm_90, gfx90a, gfx942, gfx950",
    "gpu": "needs a CUDA or ROCm device",
    "slow": "large inputs (offsets past 2^31 elements)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    # The interpreter evaluates with numpy, which warns where exp overflows to inf on
    # purpose (sigmoid of large negative inputs) and where tl.where's untaken branch is
    # inf * 0; the values are checked against the reference all the same.
    config.addinivalue_line("filterwarnings", "ignore:overflow encountered in exp:RuntimeWarning")
    config.addinivalue_line("filterwarnings", "ignore:invalid value encountered in multiply:RuntimeWarning")
    os.environ.setdefault("OPENKERNELS_STRICT", "1")
    if triton_interpreting():
        from .interpreter import install_bf16_round_to_nearest

        install_bf16_round_to_nearest()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    interpreting = triton_interpreting()
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(pytest.mark.skip(reason="needs TRITON_INTERPRET=1"))
        if "aot" in item.keywords and (interpreting or not triton_available()):
            item.add_marker(
                pytest.mark.skip(reason="compile-only checks need triton and no TRITON_INTERPRET")
            )
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA or ROCm device"))
    # The compile checks last (stable order otherwise): from empty caches they are most of a CPU
    # run's time and compile in two worker processes, so run last they have both cores of a
    # 2-core CI machine once the side-by-side interpreter run is done, where in file order
    # the serial tests after them would leave one core idle.
    items[:] = [i for i in items if "aot" not in i.keywords] + [i for i in items if "aot" in i.keywords]


@pytest.fixture
def devices() -> list[str]:
    """Devices the kernel tests run on here: cpu, plus cuda when a GPU is present."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
