"""Fixtures of the shared tests: `script` loads a file of benchmarks/ as a fresh module (they
are scripts, not an importable package), so a test can patch it freely; `toy_library` builds
a test's own C++ kernels as a family's CPU backend does."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from openkernels.shared import cpu_build, replay

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def script() -> Callable[[str], ModuleType]:
    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def toy_library(tmp_path_factory) -> Callable[[str, str, Mapping[str, Sequence[Any]]], Any]:
    """toy_library(source_text, name, signatures): the C++ source compiled and loaded through
    cpu_build.KernelLibrary (argument types declared, the kernels seen by replay recordings);
    skips the test where the replay extension cannot be built."""

    def build(source_text: str, name: str, signatures: Mapping[str, Sequence[Any]]) -> Any:
        if not replay.available():
            pytest.skip("the replay extension cannot be built here")
        source = tmp_path_factory.mktemp("toy") / f"{name}.cpp"
        source.write_text(source_text)
        return cpu_build.KernelLibrary(source, name=name, signatures=signatures)()

    return build
