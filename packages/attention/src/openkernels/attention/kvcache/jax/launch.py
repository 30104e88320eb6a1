"""The KV-cache kernels launched on JAX arrays (backends "triton" and "interpret"), through the
launch plan the PyTorch launcher uses (../triton/plan.py); the launch helpers are
../../core/jax/launch.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from ...core.jax.launch import arch, optional_pointers, run_kernel
from ..triton import kernels as KV
from ..triton import plan

__all__ = ["attention_kvcache"]


def _sm_count() -> int:
    """SMs (CUs) of the GPU, for the split plan; 4 under the interpreter, as PyTorch's CPU
    launches assume (the split path then runs in tests)."""
    if okjax.backend() != "triton":
        return 4
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cos, sin, slopes, p: plan.KVProblem,
                      leftpad=None):  # fmt: skip
    """out (like q), lse (B, Hq, Sq) float32 from `_attention_kvcache_fwd_kernel` (and the
    combine kernel when the keys are split) on a 16-bit cache, contiguous or paged; cos, sin
    (rows, R / 2) or None; slopes (B, Hq) float32 or None; cache_seqlens and leftpad as the
    backends take them (../reference.py: storage slots filled, the padding included)."""
    from .. import triton as launcher  # its FORCE_SPLITS pins the splits of both front ends

    lse_shape = (p.batch, p.heads_q, p.seqlen_q)
    side = plan.contiguous(k_cache.shape, False)
    kv = plan.kvcache(
        p, arch(), _sm_count(), (plan.contiguous(q.shape, False), side, side, (0, 0, 0)),
        plan.contiguous(q.shape, False), (p.heads_q * p.seqlen_q, p.seqlen_q, 1),
        (0 if block_table is None else block_table.shape[1], 0 if cos is None else cos.shape[1]),
        okjax.backend() == "triton" and okjax.gpu_vendor() == "cuda", False, None, launcher.FORCE_SPLITS,
    )  # fmt: skip
    dummy16 = jnp.zeros((1,), jnp.float16)  # the scales of a quantized cache: not read at 16 bits
    inputs = {"q_ptr": q, "k_ptr": k_cache, "v_ptr": v_cache, "k_scale_ptr": dummy16, "k_zero_ptr": dummy16,
              "v_scale_ptr": dummy16, "v_zero_ptr": dummy16, "seqlens_ptr": cache_seqlens}  # fmt: skip
    optional_pointers(
        inputs,
        block_table_ptr=block_table,
        cos_ptr=cos,
        sin_ptr=sin,
        slopes_ptr=slopes,
        leftpad_ptr=leftpad,
        res_ptr=None,
        kn_ptr=None,  # the fused append is the PyTorch static cache's
        vn_ptr=None,
    )
    if kv.combine is None:
        outputs = {
            "o_ptr": jax.ShapeDtypeStruct(q.shape, q.dtype),
            "lse_ptr": jax.ShapeDtypeStruct(lse_shape, jnp.float32),
        }
        return run_kernel(KV._attention_kvcache_fwd_kernel, kv.main, inputs, outputs)
    partial = {"o_ptr": jax.ShapeDtypeStruct(kv.partial_out, jnp.float32),
               "lse_ptr": jax.ShapeDtypeStruct(kv.partial_lse, jnp.float32)}  # fmt: skip
    part_o, part_lse = run_kernel(KV._attention_kvcache_fwd_kernel, kv.main, inputs, partial)
    outputs = {
        "o_ptr": jax.ShapeDtypeStruct(q.shape, q.dtype),
        "lse_ptr": jax.ShapeDtypeStruct(lse_shape, jnp.float32),
    }
    return run_kernel(
        KV._attention_kvcache_combine_kernel,
        kv.combine,
        {"part_o_ptr": part_o, "part_lse_ptr": part_lse, "advance_ptr": jnp.zeros((1,), jnp.int32)},
        outputs,
    )
