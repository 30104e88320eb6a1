"""Weights, shapes, implementations and the error bound the quant tests share."""

from __future__ import annotations

import pytest
import torch

import openkernels.quant as Q
from openkernels.quant import reference as R
from openkernels.shared.dev.testing import testable_implementations
from openkernels.shared.platform import triton_interpreting

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

# (kind, symmetric) formats; group sizes per format.
FORMATS = [("int4", False), ("int4", True), ("nf4", True)]


def targets(op: str = "int4_linear"):
    """(device, implementation) pairs testable in this process, with marks."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    params = []
    for device in devices:
        for impl in testable_implementations(op, device):
            if impl == "wgmma" and not SM90:
                continue  # the Gluon Hopper kernel: its dispatch predicate takes sm_90 only
            marks = [pytest.mark.interpreter] if triton_interpreting() else []
            if device != "cpu":
                marks.append(pytest.mark.gpu)
            params.append(pytest.param(device, impl, id=f"{device}-{impl}", marks=marks))
    return params


def make_weight(
    n: int, k: int, *, heavy: bool = False, generator: torch.Generator | None = None, device: str = "cpu"
) -> torch.Tensor:
    """A float32 weight (N, K) on `device`: Gaussian, or heavy-tailed like trained LLM weights
    (Student-t with 3 degrees of freedom plus a few outlier input channels 20x larger). Off the
    CPU the values come from a generator on that device seeded from `generator` (the CPU took
    tens of seconds per 28672 x 8192 heavy weight)."""
    if device != "cpu":
        seed = int(torch.randint(2**62, (1,), generator=generator))
        generator = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=generator, device=device) * 0.02
    if heavy:
        chi = torch.randn(n, k, 3, generator=generator, device=device).square().sum(-1)
        w = 0.02 * torch.randn(n, k, generator=generator, device=device) / (chi / 3).sqrt()
        cols = torch.randperm(k, generator=generator, device=device)[: max(1, k // 64)]
        w[:, cols] *= 20
    return w


def quantize(w: torch.Tensor, kind: str, symmetric: bool, group_size: int | None) -> Q.Int4Weight:
    if kind == "nf4":
        return Q.quantize_nf4(w, group_size)
    return Q.quantize_int4(w, group_size, symmetric)


def rounds_weight(
    impl: str, kind: str, m: int, n: int, k: int, group: int, device: str, dtype: torch.dtype, has_bias: bool
) -> bool:
    """Whether the path the launcher picks rounds W (or the NF4 levels) to x's dtype before
    the products: the dequantize + matmul paths of large M (Triton; the CPU's with bfloat16
    x and no bias, where its GEMM is fast), the CPU kernel's vdpbf16ps path (bfloat16 x of a
    few rows or more, cpu.rounds_weight), and NF4 levels in the MMA."""
    if impl == "cpu":
        from openkernels.quant.cpu import rounds_weight as cpu_rounds_weight

        return cpu_rounds_weight(m, dtype, has_bias)
    if impl == "gemv":  # the CUDA C++ kernels; calls they do not take run the Triton launcher
        if kind == "nf4" and device == "cuda" and torch.cuda.is_available():
            from openkernels.quant import cuda as G

            config = G.default_config(m, n, k, group, G._arch(torch.device(device)), kind=kind)
            if str(config).startswith("tc"):
                return True  # NF4 on the tensor-core GEMV: its levels rounded to x's dtype
        if m == 1 and k % 32 == 0 and group % 32 == 0 and n % 4 == 0:
            return False  # the GEMV: exact weights
        if 1 < m <= 16 and kind == "int4" and k % 128 == 0 and group % 32 == 0 and n % 32 == 0:
            return True  # the tensor-core kernel rounds W to x's dtype
        impl = "triton"
    if impl == "wgmma":  # the Gluon Hopper kernel rounds W to x's dtype; calls it refuses run Triton
        from openkernels.quant import gluon

        if (
            gluon.MIN_M <= m <= gluon.MAX_M
            and kind in ("int4", "nf4")
            and gluon.config_for(m, n, k, group) is not None
        ):
            return True
        impl = "triton"
    if impl != "triton":
        return False
    from openkernels.quant.triton import config_for

    path = config_for(m, n, k, group, torch.device(device), kind).path
    return path == "dequant" or (kind == "nf4" and path == "tiled")


def _zero_folded_abs_sum(out, xd, weight: Q.Int4Weight):
    """The CPU GEMV (x of at most 6 rows, int4) multiplies x by the codes and takes zero *
    scale * sum(x) off per group: its accumulation error scales with sum_k |x_k| s (|q_k| + |z|)
    (reference.linear_error_bound's abs_sum); None elsewhere."""
    if out.device.type != "cpu" or weight.kind != "int4" or xd.shape[0] > 6:
        return None
    w = weight.to("cpu")
    q = torch.stack((w.qweight & 0xF, w.qweight >> 4), dim=-1).reshape(w.qweight.shape[0], -1).double()
    k = q.shape[1]
    group = w.group_size
    s = w.scales.double().repeat_interleave(group, 0)[:k].t()
    z = 8.0 if w.zeros is None else w.zeros.double().repeat_interleave(group, 0)[:k].t()
    magnitude = s.abs() * (q + torch.as_tensor(z).abs())
    xs = xd if w.perm is None else xd[:, w.perm]
    return xs.abs() @ magnitude.t()


def assert_linear_close(out, x, weight: Q.Int4Weight, bias, *, w_rounded: bool, msg: str = "") -> None:
    """|out - ref| within reference.linear_error_bound, elementwise, with ref the float64
    product of x and the dequantized weight; NaN never passes."""
    # On the output's device: at the GPU cases' sizes (28672 x 8192) the CPU's float64 reference
    # took minutes per case, and GPU test runs ran out of their time limits (docs/perf.md).
    dev = out.device
    xd = x.detach().double().to(dev)
    if dev.type == "cpu":
        w = Q.dequantize_int4(weight.to("cpu"), torch.float64)
    else:  # float64 through the reference (the op's GPU kernels need not take float64)
        w = R.dequantize_int4_ref(weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.kind,
                                  torch.float64)  # fmt: skip
        if weight.perm is not None:
            restored = torch.empty_like(w)
            restored[:, weight.perm] = w
            w = restored
    ref = xd @ w.t()
    if bias is not None:
        ref = ref + bias.detach().double().to(dev)
    bound = R.linear_error_bound(xd, w, ref, out.dtype, weight_rounded_to=x.dtype if w_rounded else None,
                                 abs_sum=_zero_folded_abs_sum(out, xd, weight))  # fmt: skip
    got = out.detach().double()
    assert got.shape == ref.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{msg}: NaN in the output"
    excess = (got - ref).abs() - bound
    if (excess > 0).any():
        worst = int(excess.argmax())
        raise AssertionError(
            f"{msg}: {int((excess > 0).sum())} outputs out of bound, worst at {worst}: got "
            f"{got.flatten()[worst]:.6g}, ref {ref.flatten()[worst]:.6g}, bound {bound.flatten()[worst]:.3g}"
        )
