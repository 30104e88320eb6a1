"""The activation codes are spec.Act's everywhere: the C++ enum and the Triton constants carry
its values, every code has its own branch in both backends, and a code none handles fails
(it computed relu^2 in an `else:` on both before)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from openkernels.activations.spec import Act
from openkernels.shared import cpu_build

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "openkernels" / "activations"
UNKNOWN = max(Act) + 1


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def test_the_cpp_enum_is_spec_act() -> None:
    source = (PACKAGE / "cpu" / "activations.cpp").read_text()
    body = re.search(r"enum Act \{([^}]*)\}", source).group(1)
    cpp = {
        _snake(name.strip().removeprefix("k")): int(value)
        for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", body)
    }
    assert cpp == {a.name: int(a) for a in Act}


def test_the_triton_constants_are_spec_act() -> None:
    pytest.importorskip("triton")
    from openkernels.activations.triton import kernels

    for act in Act:
        assert int(getattr(kernels, f"_{act.name}")) == int(act)
    source = (PACKAGE / "triton" / "kernels.py").read_text()
    assert not re.search(r"ACT == \d", source), "activation codes as integer literals"


def test_an_unknown_code_does_not_compile_in_triton() -> None:
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, CompilationError

    from openkernels.activations.triton import kernels

    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "stride_x": "i32",
                 "stride_out": "i32", "ACT": "constexpr", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr",
                 "EVEN": "constexpr"}  # fmt: skip
    for code, ok in ((int(Act.RELU_SQUARED), True), (UNKNOWN, False)):
        src = ASTSource(kernels._activation_fwd_kernel, signature,
                        constexprs={"ACT": code, "BLOCK_R": 4, "BLOCK_C": 128, "EVEN": False})  # fmt: skip
        if ok:
            triton.compile(src, target=GPUTarget("cuda", 80, 32))
        else:
            with pytest.raises(CompilationError) as info:
                triton.compile(src, target=GPUTarget("cuda", 80, 32))
            chain, error = [], info.value
            while error is not None:  # Triton reports the call site; the assertion is its cause
                chain.append(str(error))
                error = error.__cause__
            assert any("unknown activation code" in message for message in chain), chain


@pytest.mark.skipif(cpu_build.no_compiler_reason() is not None, reason="no C++ compiler")
def test_an_unknown_code_is_refused_by_the_cpu_kernels() -> None:
    from openkernels.activations import cpu

    x = torch.randn(4, 8)
    out = torch.empty_like(x)
    cpu.unary_fwd(x, out, int(Act.RELU_SQUARED))
    torch.testing.assert_close(out, torch.relu(x) ** 2)
    with pytest.raises(ValueError, match="unknown activation code"):
        cpu.unary_fwd(x, out, UNKNOWN)
