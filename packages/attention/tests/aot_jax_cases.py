"""Ahead-of-time compile cases of the attention kernels as JAX launches them, checked by
test_aot.py for sm_80, sm_90, gfx90a, gfx942, gfx950: jax-triton passes every integer and
float argument (sizes, strides, scales, windows) as a compile-time constant, so these
specializations differ from the PyTorch ones (known loop bounds and offsets). The cases come
from the launch plans JAX uses (core/, kvcache/ and rotary/ triton/plan.py, contiguous operands): the benchmark's fast
path (causal, D128) and general calls with every flag (varlen, windows, ALiBi, softcap, GQA,
a padded head_dim), forward and the three backward kernels, attention against a 16-bit KV
cache (decode; paged chunked prefill with split keys and their combine), and the rotary
kernel. A few
representative calls, not every config: test_aot.py's cases bound the registers per config."""

from __future__ import annotations

import torch

from openkernels.attention.core.triton import plan
from openkernels.attention.kvcache.triton import plan as kv_plan
from openkernels.attention.rotary.triton import plan as rotary_plan

_KERNELS = "openkernels.attention.core.triton.kernels"
_KVCACHE = "openkernels.attention.kvcache.triton.kernels"
_ROTARY = "openkernels.attention.rotary.triton.kernels:_apply_rotary_kernel"
# num_stages of the launches left to Triton's default (core/jax/launch.py's _DEFAULT_STAGES).
_DEFAULT_STAGES = {"cuda": 3, "hip": 2}

# (label, problem, tokens_q, tokens_k): tokens only matter for varlen (lse's head stride).
_P = plan.Problem
_CALLS = (
    # B8 S2048 H16 D128 causal bf16: the benchmark's shape, the fast configs.
    ("causal-d128", _P(8, 2048, 2048, 16, 16, 128, False, 128**-0.5, -1, 0, False, 0.0), 0, 0),
    # Packed sequences with a sliding window, ALiBi, softcap and GQA 4: the general configs.
    ("varlen-all-d128", _P(4, 1000, 1200, 16, 4, 128, True, 0.1, 64, 0, True, 30.0), 3001, 4003),
    # Odd lengths, head_dim 96 (a masked pad of the tiles), MQA, a two-sided window.
    ("odd-window-d96", _P(2, 999, 777, 8, 1, 96, False, 96**-0.5, 32, 16, True, 5.0), 0, 0),
)
_ROTARY_CALLS = (
    ("rotary-d128", (8, 2048, 32, 128), 8, (1, 2048, 128)),  # Llama 3 8B prefill, GQA 32/8
    ("rotary-d80-r32", (4, 2048, 32, 80), 32, (4, 2048, 32)),  # Phi-2: 32 of 80 rotate
)


def _case(kernel: str, launch: plan.Launch, pointers: dict[str, str], backend: str, label: str, extra=None):
    from openkernels.shared.dev.testing.aot import AotCase

    stages = launch.num_stages if launch.num_stages is not None else _DEFAULT_STAGES[backend]
    constexprs = {**launch.args, **(extra or {})}
    return AotCase(kernel, pointers, constexprs, num_warps=launch.num_warps, num_stages=stages,
                   label=f"jax-{label}")  # fmt: skip


def _attention_cases(arch: str, backend: str) -> list:
    act, f32, i32 = "*bf16", "*fp32", "*i32"
    out = []
    for label, p, tokens_q, tokens_k in _CALLS:
        if not p.varlen:
            tokens_q, tokens_k = p.n_seqs * p.seqlen_q, p.n_seqs * p.seqlen_k
        launches = plan.contiguous_launches(p, arch, torch.bfloat16, tokens_q, tokens_k)
        part = act if p.group == 1 else f32
        opt = {"cu_q_ptr": i32, "cu_k_ptr": i32, "slopes_ptr": f32, "seed_ptr": i32}  # dummies when absent
        base = {"q_ptr": act, "k_ptr": act, "v_ptr": act}
        grads_in = {**base, "do_ptr": act, "lse_ptr": f32, "delta_ptr": f32, **opt}
        out += [
            _case(f"{_KERNELS}:_attn_fwd_kernel", launches.fwd, {**base, **opt, "o_ptr": act, "lse_ptr": f32},
                  backend, f"fwd-{label}", {"USE_TMA": False}),
            _case(f"{_KERNELS}:_attn_bwd_dkdv_kernel", launches.dkdv, {**grads_in, "dk_ptr": part, "dv_ptr": part},
                  backend, f"dkdv-{label}"),
            _case(f"{_KERNELS}:_attn_bwd_dq_kernel", launches.dq, {**grads_in, "dq_ptr": act}, backend, f"dq-{label}"),
        ]  # fmt: skip
        if p.varlen:  # the delta pass is the same loop-free kernel for every call
            out.append(_case(f"{_KERNELS}:_attn_bwd_preprocess_kernel", launches.preprocess,
                             {"o_ptr": act, "do_ptr": act, "cu_q_ptr": i32, "delta_ptr": f32}, backend,
                             f"preprocess-{label}"))  # fmt: skip
    return out


# (label, problem, capacity per sequence or page count): decode on a contiguous cache, and
# chunked prefill on a paged cache with every flag (its keys split: float32 partials).
_KV = kv_plan.KVProblem
_KV_CALLS = (
    (
        "kv-decode-d128",
        _KV(32, 1, 32, 8, 128, 16, 128, 1, 4096, 128**-0.5, -1, 0, False, 0.0, 0, 0, False),
        4096,
    ),
    (
        "kv-paged-all-d128",
        _KV(4, 16, 32, 8, 128, 16, 128, 16, 8192, 0.1, 1024, 0, True, 30.0, 16, 64, False),
        2048,
    ),
)


def _kvcache_cases(arch: str, backend: str) -> list:
    out = []
    for label, p, lead in _KV_CALLS:
        q = (p.batch, p.seqlen_q, p.heads_q, p.head_dim)
        side = plan.contiguous((lead, p.page_size or 4096, p.heads_kv, p.head_dim), False)
        kv = kv_plan.kvcache(p, arch, 132, (plan.contiguous(q, False), side, side, (0, 0, 0)), plan.contiguous(q, False),
                          (p.heads_q * p.seqlen_q, p.seqlen_q, 1), (8192 // 16 if p.page_size else 0, p.rot_half),
                          backend == "cuda")  # fmt: skip
        dst = "*bf16" if kv.combine is None else "*fp32"
        pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", **dict.fromkeys(
            ("k_scale_ptr", "k_zero_ptr", "v_scale_ptr", "v_zero_ptr"), "*fp16"), "seqlens_ptr": "*i32",
            "block_table_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slopes_ptr": "*fp32",
            "leftpad_ptr": "*i32", "res_ptr": "*fp16", "kn_ptr": "*fp16", "vn_ptr": "*fp16", "o_ptr": dst,
            "lse_ptr": "*fp32"}  # fmt: skip
        out.append(_case(f"{_KVCACHE}:_attention_kvcache_fwd_kernel", kv.main, pointers, backend, label))
        if kv.combine is not None and not any(c.label.endswith("combine") for c in out):  # one is enough
            combine = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "advance_ptr": "*i32", "o_ptr": "*bf16",
                       "lse_ptr": "*fp32"}  # fmt: skip
            out.append(_case(f"{_KVCACHE}:_attention_kvcache_combine_kernel", kv.combine, combine, backend,
                             f"{label}-combine"))  # fmt: skip
    return out


def _rotary_cases(arch: str, backend: str) -> list:
    out = []
    for label, shape_q, heads_k, table in _ROTARY_CALLS:
        for backward in (False, True):
            launch = rotary_plan.contiguous_rotary(shape_q, heads_k, table, backward, arch)
            pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                        "qo_ptr": "*bf16", "ko_ptr": "*bf16"}  # fmt: skip
            out.append(_case(_ROTARY, launch, pointers, backend, f"{label}{'-bwd' if backward else ''}"))
    return out


def cases_for(arch: str) -> list:
    """The JAX specializations on `arch` ("sm_90", "gfx942", ...)."""
    backend = "hip" if arch.startswith("gfx") else "cuda"
    return _attention_cases(arch, backend) + _kvcache_cases(arch, backend) + _rotary_cases(arch, backend)
