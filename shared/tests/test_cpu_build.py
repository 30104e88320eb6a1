"""Tests of openkernels.shared.cpu_build's shared headers: the include path and the cache key."""

from __future__ import annotations

import ctypes
import math
import struct

import pytest

from openkernels.shared import cpu_build

HEADER = cpu_build.INCLUDE_DIR / "openkernels_cpu.h"


def test_header_ships_beside_cpu_build() -> None:
    assert HEADER.is_file()
    assert "OPENKERNELS_CPU_H_" in HEADER.read_text()


def test_command_puts_include_dir_on_the_path(tmp_path) -> None:
    source = tmp_path / "k.cpp"
    command = cpu_build._command(("c++",), source, cpu_build.BASE_FLAGS)
    i = command.index("-I")
    assert command[i + 1] == str(cpu_build.INCLUDE_DIR)
    assert command[-1] == str(source)


def test_cache_key_covers_headers(tmp_path, monkeypatch) -> None:
    source = tmp_path / "k.cpp"
    source.write_text('#include "h.h"\n')
    include = tmp_path / "include"
    include.mkdir()
    monkeypatch.setattr(cpu_build, "INCLUDE_DIR", include)
    cmd, flags = ("c++",), cpu_build.BASE_FLAGS

    keys = [cpu_build._cache_key(cmd, source, flags)]
    (include / "h.h").write_text("int a;\n")
    keys.append(cpu_build._cache_key(cmd, source, flags))
    (include / "h.h").write_text("int b;\n")  # edited
    keys.append(cpu_build._cache_key(cmd, source, flags))
    (include / "other.h").write_text("")  # added
    keys.append(cpu_build._cache_key(cmd, source, flags))
    (include / "notes.txt").write_text("not a header")
    keys.append(cpu_build._cache_key(cmd, source, flags))
    assert len(set(keys[:4])) == 4
    assert keys[4] == keys[3]  # only headers count
    assert cpu_build._cache_key(cmd, source, flags) == keys[3]  # stable


def test_cache_key_covers_the_headers_beside_the_source(tmp_path) -> None:
    """A family's own header (`#include "common.h"` beside the source) is part of the key:
    editing it rebuilds every library that includes it."""
    source = tmp_path / "k.cu"
    source.write_text('#include "common.h"\n')
    cmd, flags = ("c++",), cpu_build.BASE_FLAGS
    keys = [cpu_build._cache_key(cmd, source, flags)]
    (tmp_path / "common.h").write_text("int a;\n")
    keys.append(cpu_build._cache_key(cmd, source, flags))
    (tmp_path / "common.h").write_text("int b;\n")
    keys.append(cpu_build._cache_key(cmd, source, flags))
    (tmp_path / "other.cu").write_text("int c;\n")  # a sibling source: not included, not counted
    keys.append(cpu_build._cache_key(cmd, source, flags))
    assert len(set(keys[:3])) == 3
    assert keys[3] == keys[2]


def _bf16_bits(v: float) -> int:
    """torch's float -> bfloat16 rounding (nearest even; NaN quiet), as bits."""
    torch = pytest.importorskip("torch")
    return torch.tensor([v], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


@pytest.mark.skipif(not cpu_build.compiler_available(), reason="no C++ compiler")
def test_header_compiles_and_converts(tmp_path, monkeypatch) -> None:
    """A source including the shared header builds through load_library (fresh cache)."""
    monkeypatch.setenv("OPENKERNELS_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "uses_header.cpp"
    source.write_text(
        '#include "openkernels_cpu.h"\n'
        'extern "C" int ok_bf16_store(float v) { return bf16_store(v); }\n'
        'extern "C" int ok_f16_store(float v) { return f16_store(v); }\n'
        'extern "C" void ok_f16_roundtrip(const float* x, float* y, int64_t n) {\n'
        "  uint16_t h[64];\n"
        "  float_to_f16(x, h, n);\n"
        "  f16_to_float(h, y, n);\n"
        "}\n"
    )
    lib = cpu_build.load_library(source, name="openkernels_test_header")
    lib.ok_bf16_store.argtypes = lib.ok_f16_store.argtypes = [ctypes.c_float]
    lib.ok_f16_roundtrip.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    # 11 values: 8 through the vector loop (F16C), 3 through the scalar tail.
    values = [0.1, -2.5e-8, 65519.0, 65520.0, 1e-7, -0.0, 3.0, 1 / 3, 0.1, 65520.0, 1e-7]
    x, y = (ctypes.c_float * len(values))(*values), (ctypes.c_float * len(values))()
    lib.ok_f16_roundtrip(x, y, len(values))
    expected = [struct.unpack("<e", struct.pack("<e", v))[0] if v < 65520.0 else math.inf for v in x]
    assert list(y) == expected
    assert (tmp_path / "cache" / "cpu").is_dir()
