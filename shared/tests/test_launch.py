"""shared.launch: the specialization key of a direct launch, the fallback to kernel[grid],
and on a GPU, direct launches that give what kernel[grid] gives when alignments and
specialized integers change between calls."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from openkernels.shared import launch as L
from openkernels.shared.platform import triton_interpreting


@triton.jit
def _affine_kernel(x_ptr, out_ptr, n, offset, scale, BLOCK: tl.constexpr, ADD: tl.constexpr = True):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    y = x * scale
    if ADD:
        y += offset
    tl.store(out_ptr + i, y, mask=i < n)


def _key(*values, warps=4, stages=None):
    return L.specialization_key(_affine_kernel, values, warps, stages, 0)


jit_only = pytest.mark.skipif(triton_interpreting(), reason="keys are read from a JITFunction's parameters")


@jit_only
def test_key_follows_what_triton_specializes() -> None:
    x = torch.zeros(64, dtype=torch.float32)
    out = torch.zeros(64, dtype=torch.float32)
    base = _key(x, out, 64, 3, 0.5, 16, True)
    # Tensor address alignment (16 bytes) and dtype.
    assert _key(x[1:], out, 64, 3, 0.5, 16, True) != base
    assert _key(x[4:], out, 64, 3, 0.5, 16, True) == base  # 16 bytes on: aligned again
    assert _key(x.half(), out, 64, 3, 0.5, 16, True) != base
    # Integers: == 1, divisible by 16, 32-bit range.
    assert _key(x, out, 48, 3, 0.5, 16, True) == base
    assert _key(x, out, 63, 3, 0.5, 16, True) != base
    assert _key(x, out, 64, 1, 0.5, 16, True) != base
    assert _key(x, out, 64, 2**31 + 3, 0.5, 16, True) != base
    # Floats by type alone; constexprs by value; launch options.
    assert _key(x, out, 64, 3, 2.0, 16, True) == base
    assert _key(x, out, 64, 3, 0.5, 32, True) != base
    assert _key(x, out, 64, 3, 0.5, 16, False) != base
    assert _key(x, out, 64, 3, 0.5, 16, True, warps=8) != base
    assert _key(x, out, 64, 3, 0.5, 16, True, stages=2) != base


def test_tma_descriptors_key_by_type_never_by_value() -> None:
    """A host TMA descriptor holds a tensor (no usable ==, no hash): keyed by base dtype,
    block shape, shared layout and padding as Triton types it; its shape and strides are
    launcher arguments. Checked against Triton's own specialization where Gluon is there."""
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    wide = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)

    def desc(t, block=(64, 128), lay=layout):
        return gluon_hopper.TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), lay)

    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    half = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float16)
    same = [desc(x), desc(torch.zeros(17, 512, dtype=torch.bfloat16)), desc(x[:, :128])]
    different = [desc(x.half(), lay=half), desc(x, (64, 64), wide)]
    keys = [tuple(L._key_parts([d])) for d in same + different]
    assert len({hash(k) for k in keys[:3]}) == 1 and len(set(keys)) == 3
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return
    # The key is a superset of Triton's: descriptors Triton types apart never share one.
    typed = [native_specialize_impl(BaseBackend, d, False, True, True) for d in same + different]
    for a in range(len(keys)):
        for b in range(len(keys)):
            if typed[a] != typed[b]:
                assert keys[a] != keys[b]


@jit_only
def test_bind_fills_defaults_and_names_bad_arguments() -> None:
    x = torch.zeros(8)
    values = L._bind(_affine_kernel, (x, x, 8, 0, 1.0), {"BLOCK": 8})
    assert values[-1] is True  # ADD's default
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        L._bind(_affine_kernel, (x, x, 8, 0, 1.0), {})
    with pytest.raises(TypeError, match="unexpected arguments \\['BLOK'\\]"):
        L._bind(_affine_kernel, (x, x, 8, 0, 1.0), {"BLOCK": 8, "BLOK": 8})


@pytest.mark.interpreter
def test_cpu_tensors_take_kernel_grid() -> None:
    if not triton_interpreting():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    x = torch.arange(10, dtype=torch.float32)
    out = torch.empty_like(x)
    L.launch(_affine_kernel, (2,), x, out, 10, 3, 2.0, BLOCK=8, num_warps=4)
    torch.testing.assert_close(out, x * 2 + 3)


@pytest.mark.gpu
def test_direct_launches_match_kernel_grid_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    L.clear()
    buf = torch.randn(1000, device="cuda")
    for start, n, offset, scale, add in [(0, 1000, 3, 0.5, True), (0, 1000, 1, 0.5, True), (1, 999, 16, 2.0, True),
                                         (0, 1000, 3, 0.5, True), (1, 997, 1, -1.0, False), (4, 996, 2, 1.5, True)]:  # fmt: skip
        x = buf[start : start + n]
        got = torch.full_like(x, float("nan"))
        want = torch.full_like(x, float("nan"))
        L.launch(
            _affine_kernel, (triton.cdiv(n, 128),), x, got, n, offset, scale, BLOCK=128, ADD=add, num_warps=4
        )
        L.launch(
            _affine_kernel, (triton.cdiv(n, 128),), x, got, n, offset, scale, BLOCK=128, ADD=add, num_warps=4
        )
        _affine_kernel[(triton.cdiv(n, 128),)](x, want, n, offset, scale, BLOCK=128, ADD=add, num_warps=4)
        assert torch.equal(got, want), (start, n, offset, scale, add)
    assert len(L._compiled) >= 4  # aligned/misaligned, offset 1 vs not, ADD on/off: separate entries


@pytest.mark.gpu
def test_direct_launch_still_calls_launch_hooks_on_gpu() -> None:
    """The direct path skips Triton's launch metadata only while no hook is set (profilers
    such as Proton add one): with a hook, every launch reaches it, the direct ones too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no launch hook chain")
    L.clear()
    x = torch.randn(256, device="cuda")
    out = torch.empty_like(x)
    seen = []

    def hook(metadata) -> None:
        seen.append(metadata.get()["name"])  # a triton LazyDict

    chain.add(hook)
    try:
        for _ in range(3):  # the first compiles through kernel[grid], the next two launch directly
            L.launch(_affine_kernel, (2,), x, out, 256, 3, 2.0, BLOCK=128, num_warps=4)
    finally:
        chain.remove(hook)
    torch.cuda.synchronize()
    assert seen == ["_affine_kernel"] * 3
    torch.testing.assert_close(out, x * 2 + 3)


@jit_only
def test_prepare_checks_its_arguments_once() -> None:
    with pytest.raises(TypeError, match="no parameters \\['BLOK'\\]"):
        L.prepare(_affine_kernel, ("x_ptr", "out_ptr"), n=8, offset=0, scale=1.0, BLOK=8)
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        L.prepare(_affine_kernel, ("x_ptr", "out_ptr"), n=8, offset=0, scale=1.0)
    with pytest.raises(TypeError, match="constexpr parameters cannot vary"):
        L.prepare(_affine_kernel, ("x_ptr", "out_ptr", "BLOCK"), n=8, offset=0, scale=1.0)
    with pytest.raises(TypeError, match="both varying and fixed"):
        L.prepare(_affine_kernel, ("x_ptr", "out_ptr", "n"), n=8, offset=0, scale=1.0, BLOCK=8)
    prepared = L.prepare(_affine_kernel, ("x_ptr", "out_ptr"), n=8, offset=0, scale=1.0, BLOCK=8)
    with pytest.raises(TypeError, match="expected values for"):
        prepared((1,), torch.zeros(8))  # one of the two varying values: an error, not a default
    assert prepared.varying == ("x_ptr", "out_ptr") and prepared.fixed == {
        "n": 8,
        "offset": 0,
        "scale": 1.0,
        "BLOCK": 8,
    }


@pytest.mark.interpreter
def test_prepared_launch_on_the_interpreter() -> None:
    if not triton_interpreting():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    x = torch.arange(10, dtype=torch.float32)
    out = torch.full_like(x, float("nan"))
    L.prepare(_affine_kernel, ("x_ptr", "out_ptr"), n=10, offset=3, scale=2.0, BLOCK=8, num_warps=4)(
        (2,), x, out
    )
    torch.testing.assert_close(out, x * 2 + 3)


@pytest.mark.gpu
def test_prepared_launches_match_kernel_grid_on_gpu() -> None:
    """One prepared launch, called on aligned and misaligned views and a None-free mix of
    dtypes: every call equals kernel[grid] on the same arguments."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    buf = torch.randn(1100, device="cuda")
    prepared = L.prepare(
        _affine_kernel, ("x_ptr", "out_ptr"), n=1000, offset=3, scale=0.5, BLOCK=128, num_warps=4
    )
    for start, out_start, dtype in [(0, 0, torch.float32), (1, 0, torch.float32), (0, 3, torch.float32),
                                    (4, 4, torch.float32), (0, 0, torch.float16), (1, 0, torch.float32)]:  # fmt: skip
        x = buf[start : start + 1000].to(dtype)
        if start % 4:  # keep the misaligned start: .to() of a same-dtype view returns the view
            x = buf.to(dtype)[start : start + 1000]
        got_buf = torch.full((1100,), float("nan"), device="cuda", dtype=dtype)
        got = got_buf[out_start : out_start + 1000]
        want = torch.full_like(got, float("nan"))
        for _ in range(2):  # the first call compiles through kernel[grid], the second is direct
            prepared((8,), x, got)
        _affine_kernel[(8,)](x, want, 1000, 3, 0.5, BLOCK=128, num_warps=4)
        assert torch.equal(got, want), (start, out_start, dtype)
    assert len(prepared._compiled) >= 3  # aligned, misaligned input, misaligned output, fp16
