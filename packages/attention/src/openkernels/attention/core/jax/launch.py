"""The attention kernels launched on JAX arrays (backends "triton" and "interpret" of
`openkernels.attention.jax`), through the launch plans the PyTorch launchers use
(../triton/plan.py): the same kernels, configs and argument values. The KV-cache and rotary
launches (../../kvcache/jax/launch.py, ../../rotary/jax/launch.py) use the helpers here.

JAX arrays are contiguous, so every stride follows from a shape (plan.contiguous_launches),
and jax-triton passes every integer and float argument as a compile-time constant (the AOT
checks compile that specialization: tests/aot_jax_cases.py). Callers handle empty inputs and
pick the dtypes (float16, bfloat16; the rotary kernel float32 too).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from ..triton import kernels as K
from ..triton import plan

__all__ = ["arch", "attention_fwd", "attention_bwd", "optional_pointers", "run_kernel"]

# num_stages of the launches PyTorch leaves to Triton's default (plan.Launch.num_stages None).
_DEFAULT_STAGES = {"cuda": 3, "rocm": 2, "cpu": 1}


@functools.cache
def _gpu_arch() -> str:
    """The arch jax-triton compiles for: "sm_90", "gfx942", ..."""
    device = jax.devices()[0]
    if okjax.gpu_vendor() == "rocm":
        name = str(getattr(device, "compute_capability", ""))
        if not name.startswith("gfx"):
            from jax._src.lib import gpu_triton  # what jax-triton itself asks on ROCm

            name = gpu_triton.get_arch_details(0)
        return name.split(":")[0]
    import jax_triton

    return f"sm_{jax_triton.get_compute_capability(0)}"


def arch() -> str:
    """The arch the launch configs are picked for; "interpreter" under the Triton
    interpreter (configs.arch_family maps any non-GPU arch there)."""
    return _gpu_arch() if okjax.backend() == "triton" else "interpreter"


def _stages(launch: plan.Launch) -> int:
    if launch.num_stages is not None:
        return launch.num_stages
    return _DEFAULT_STAGES[okjax.gpu_vendor()]


def optional_pointers(inputs: dict, **pointers: Any) -> None:
    """Absent optional pointers (cu_seqlens of dense calls, no ALiBi, no block table or rotary
    tables) become one-element dummies: jax-triton binds arrays to the leading parameters by
    position, so a pointer between two inputs cannot be a constant None; the kernels read
    them only under their constexpr flags (IS_VARLEN, HAS_ALIBI, PAGE_SIZE, HAS_ROTARY)."""
    dummies = {"cu_q_ptr": jnp.int32, "cu_k_ptr": jnp.int32, "slopes_ptr": jnp.float32, "block_table_ptr": jnp.int32,
               "cos_ptr": jnp.float32, "sin_ptr": jnp.float32, "leftpad_ptr": jnp.int32,
               "res_ptr": jnp.float16, "seed_ptr": jnp.int32, "kn_ptr": jnp.float16, "vn_ptr": jnp.float16,
               "advance_ptr": jnp.int32}  # fmt: skip
    for name, value in pointers.items():
        inputs[name] = jnp.zeros((1,), dummies[name]) if value is None else value


def run_kernel(kernel, launch: plan.Launch, inputs: dict, outputs: dict, extra: dict | None = None):
    return okjax.launch(kernel, grid=launch.grid, inputs=inputs, outputs=outputs,
                        constants={**launch.args, **(extra or {})}, num_warps=launch.num_warps,
                        num_stages=_stages(launch))  # fmt: skip


def _launches(q, k, p: plan.Problem) -> plan.Contiguous:
    return plan.contiguous_launches(p, arch(), okjax.torch_dtype(q.dtype), q.shape[0], k.shape[0])


def attention_fwd(q, k, v, cu_q, cu_k, slopes, p: plan.Problem, seed=None):
    """out (like q), lse float32 ((B, Hq, Sq), or (Hq, Tq) varlen) from `_attn_fwd_kernel`.
    slopes: (n_seqs, Hq) float32 or None; seed: dropout's int32 (2,) (with p.dropout) or None."""
    launches = _launches(q, k, p)
    inputs = {"q_ptr": q, "k_ptr": k, "v_ptr": v}
    optional_pointers(inputs, cu_q_ptr=cu_q, cu_k_ptr=cu_k, slopes_ptr=slopes, seed_ptr=seed)
    outputs = {"o_ptr": jax.ShapeDtypeStruct(q.shape, q.dtype),
               "lse_ptr": jax.ShapeDtypeStruct(launches.lse_shape, jnp.float32)}  # fmt: skip
    # Tensor descriptors (USE_TMA) need a device allocator jax-triton does not set up; no
    # config turns them on today.
    return run_kernel(K._attn_fwd_kernel, launches.fwd, inputs, outputs, {"USE_TMA": False})


def attention_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, slopes, p: plan.Problem, seed=None):
    """(dq, dk, dv) from the preprocess, dkdv and dq kernels, as the PyTorch launcher runs
    them; dlse (like lse, or None): the lse's cotangent, which enters as delta - dlse."""
    launches = _launches(q, k, p)
    f32 = jnp.float32
    pre_inputs = {"o_ptr": out, "do_ptr": dout}
    optional_pointers(pre_inputs, cu_q_ptr=cu_q)
    delta_out = {"delta_ptr": jax.ShapeDtypeStruct(launches.lse_shape, f32)}
    (delta,) = run_kernel(K._attn_bwd_preprocess_kernel, launches.preprocess, pre_inputs, delta_out)
    if dlse is not None:  # dS = P (dP - delta + dlse): the lse's cotangent joins the row term
        delta = delta - dlse.astype(f32)
    inputs = {"q_ptr": q, "k_ptr": k, "v_ptr": v, "do_ptr": dout, "lse_ptr": lse, "delta_ptr": delta}
    optional_pointers(inputs, cu_q_ptr=cu_q, cu_k_ptr=cu_k, slopes_ptr=slopes, seed_ptr=seed)
    # GQA: float32 per-query-head dK/dV shares, summed over each group after the kernel.
    part = jax.ShapeDtypeStruct(launches.dk_shape, k.dtype if p.group == 1 else f32)
    dk, dv = run_kernel(K._attn_bwd_dkdv_kernel, launches.dkdv, inputs, {"dk_ptr": part, "dv_ptr": part})
    if p.group > 1:
        grouped = (*k.shape[:-2], p.heads_kv, p.group, p.head_dim)
        dk, dv = (x.reshape(grouped).sum(axis=-2).astype(k.dtype) for x in (dk, dv))
    dq_out = {"dq_ptr": jax.ShapeDtypeStruct(q.shape, q.dtype)}
    (dq,) = run_kernel(K._attn_bwd_dq_kernel, launches.dq, inputs, dq_out)
    return dq, dk, dv
