"""openkernels.shared.jax: backend choice, the launch convention check, the array bridge,
and that the PyTorch API never imports JAX."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

jax = pytest.importorskip("jax")
jnp = jax.numpy
triton = pytest.importorskip("triton")
tl = triton.language

from openkernels.shared import dispatch  # noqa: E402
from openkernels.shared import jax as okjax  # noqa: E402
from openkernels.shared.dev.testing.jax import to_jax, to_torch  # noqa: E402


@triton.jit
def _inputs_then_outputs(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _constant_between_pointers(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _output_first(out_ptr, x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_default_backend_off_gpu_is_jnp() -> None:
    if okjax._on_gpu():
        pytest.skip("JAX sees a GPU here")
    assert okjax.backend() == "jnp"
    assert okjax.gpu_vendor() == "cpu"


def test_use_backend_rejects_unknown_and_unavailable_backends() -> None:
    # Worded as dispatch.force words an unknown name (an UnsupportedError, a ValueError).
    unknown = r"use_backend\(\) names 'jax:cuda', but jax has no implementation named 'cuda'"
    with pytest.raises(dispatch.UnsupportedError, match=unknown), okjax.use_backend("cuda"):
        pass
    gpu_message = "'triton' cannot run here: JAX's default backend is"
    if not okjax._on_gpu():
        with pytest.raises(RuntimeError, match=gpu_message), okjax.use_backend("triton"):
            pass
    if not okjax._interpreting():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), okjax.use_backend("interpret"):
            pass


def test_use_backend_is_scoped() -> None:
    before = okjax.backend()
    with okjax.use_backend("jnp"):
        assert okjax.backend() == "jnp"
    assert okjax.backend() == before


def test_gpu_without_jax_triton_warns_once_and_runs_jnp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(okjax, "_on_gpu", lambda: True)
    monkeypatch.setattr(okjax, "_interpreting", lambda: False)
    monkeypatch.setattr(okjax, "_jax_triton", lambda: "jax-triton does not import (no module)")
    okjax._warn_no_triton.cache_clear()
    with pytest.warns(RuntimeWarning, match="jax.numpy compositions on this GPU: jax-triton does not import"):
        assert okjax.backend() == "jnp"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert okjax.backend() == "jnp"  # once per reason, not per call
    okjax._warn_no_triton.cache_clear()


def test_launch_checks_the_argument_order() -> None:
    x = jnp.ones(8, jnp.float32)
    out = {"out_ptr": jax.ShapeDtypeStruct((8,), jnp.float32)}
    with pytest.raises(
        TypeError, match=r"_output_first cannot be launched from JAX.*inputs \['x_ptr'\] then"
    ):
        okjax.launch(_output_first, grid=(1,), inputs={"x_ptr": x}, outputs=out,
                     constants={"n": 8, "BLOCK": 8}, num_warps=1, num_stages=1)  # fmt: skip
    with pytest.raises(TypeError, match=r"has no arguments \['z_ptr'\]"):
        okjax.launch(_inputs_then_outputs, grid=(1,), inputs={"x_ptr": x, "z_ptr": x}, outputs=out,
                     constants={"n": 8, "BLOCK": 8}, num_warps=1, num_stages=1)  # fmt: skip
    with pytest.raises(TypeError, match="must start with"):  # n left as a runtime argument
        okjax.launch(_inputs_then_outputs, grid=(1,), inputs={"x_ptr": x, "y_ptr": x}, outputs=out,
                     constants={"BLOCK": 8}, num_warps=1, num_stages=1)  # fmt: skip


@pytest.mark.interpreter
def test_launch_runs_a_kernel_under_the_interpreter_inside_jit() -> None:
    x = jnp.arange(37, dtype=jnp.float32)
    y = jnp.full((37,), 0.5, jnp.bfloat16).astype(jnp.float32)

    def add(a, b):
        (out,) = okjax.launch(
            _inputs_then_outputs,
            grid=(3,),
            inputs={"x_ptr": a, "y_ptr": b},
            outputs={"out_ptr": jax.ShapeDtypeStruct(a.shape, a.dtype)},
            constants={"n": a.shape[0], "BLOCK": 16},
            num_warps=1,
            num_stages=1,
        )
        return out

    with okjax.use_backend("interpret"):
        out = jax.jit(add)(x, y)
    assert jnp.array_equal(out, x + y)


def test_launch_refuses_a_constant_between_pointers() -> None:
    # jax-triton binds arrays by position: out would land on n's slot on a GPU.
    with pytest.raises(TypeError, match="must start with the inputs"):
        okjax.launch(_constant_between_pointers, grid=(1,), inputs={"x_ptr": jnp.ones(4)},
                     outputs={"out_ptr": jax.ShapeDtypeStruct((4,), jnp.float32)},
                     constants={"n": 4, "BLOCK": 4}, num_warps=1, num_stages=1)  # fmt: skip


def test_launch_refuses_the_jnp_backend() -> None:
    with okjax.use_backend("jnp"), pytest.raises(RuntimeError, match="current JAX backend is 'jnp'"):
        okjax.launch(_inputs_then_outputs, grid=(1,), inputs={"x_ptr": jnp.ones(4), "y_ptr": jnp.ones(4)},
                     outputs={"out_ptr": jax.ShapeDtypeStruct((4,), jnp.float32)},
                     constants={"n": 4, "BLOCK": 4}, num_warps=1, num_stages=1)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8], ids=str)
def test_array_bridge_round_trips_bits(dtype: torch.dtype) -> None:
    t = (torch.randn(5, 7) * 100).to(dtype)
    back = to_torch(to_jax(t))
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    assert okjax.torch_dtype(to_jax(t).dtype) == dtype


def test_check_array_messages() -> None:
    with pytest.raises(TypeError, match=r"op: x must be a jax\.Array, got Tensor"):
        okjax.check_array("op", "x", torch.ones(2), [jnp.float32])
    with pytest.raises(TypeError, match="op: x has dtype int32; supported: float16, float32"):
        okjax.check_array("op", "x", jnp.ones(2, jnp.int32), [jnp.float16, jnp.float32])


def test_jax_triton_import_keeps_triton_cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # jax-triton 0.3 blanks TRITON_CACHE_DIR at import, which breaks every later Triton JIT
    # compile in the process (seen on the H200: the PyTorch path fell back to the reference).
    fake = tmp_path / "jax_triton"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os\nos.environ['TRITON_CACHE_DIR'] = ''\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    module = okjax._jax_triton.__wrapped__()
    assert not isinstance(module, str) and module.__file__.startswith(str(fake))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache")
    monkeypatch.delitem(sys.modules, "jax_triton")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    okjax._jax_triton.__wrapped__()
    assert "TRITON_CACHE_DIR" not in os.environ


def test_the_pytorch_api_does_not_import_jax() -> None:
    code = textwrap.dedent(
        """
        import importlib, sys
        for family in ("activations", "layernorm", "attention", "quant"):
            try:
                importlib.import_module(f"openkernels.{family}")
            except ModuleNotFoundError:
                pass
        import openkernels.shared.kernelize, openkernels.shared.dev.cli
        print(sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "jax_triton"))))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
