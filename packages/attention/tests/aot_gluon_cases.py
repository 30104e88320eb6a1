"""AOT cases of the Gluon Hopper attention kernels (core/gluon): sm_90 only, every config the
launchers pick (head_dim 64 / 128, full / causal, bf16 / fp16), the forward's ping-pong
schedule too, the backward's two kernels, with the launches' maxnreg."""

from __future__ import annotations


def _desc(dtype: str, shape: list[int]) -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16 if dtype == "bf16" else gl.float16)
    return f"tensordesc<{dtype}[{','.join(map(str, shape))}],{layout!r}>"


def cases_for(target: str) -> list:
    if target != "sm_90":
        return []  # wgmma, TMA and warp specialization: Hopper's
    from openkernels.attention.core import gluon
    from openkernels.shared.dev.testing.aot import AotCase

    cases = []
    for head_dim in gluon.HEAD_DIMS:
        block_n, stages = gluon.config(head_dim)
        for dtype, pingpong in (("bf16", False), ("fp16", False), ("bf16", True)):
            for causal in (False, True):
                signature = {
                    "q_desc": _desc(dtype, [1, gluon.ROWS, head_dim]),
                    "k_desc": _desc(dtype, [1, block_n, head_dim]),
                    "v_desc": _desc(dtype, [1, block_n, head_dim]),
                    "o_ptr": f"*{dtype}", "lse_ptr": "*fp32", "seqlen_q": "i32", "seqlen_k": "i32", "heads": "i32",
                    "kv_group": "i32", "stride_ob": "i64", "stride_os": "i32", "stride_lb": "i32",
                    "stride_lh": "i32", "qk_scale": "fp32",
                }  # fmt: skip
                constexprs = {"CAUSAL": causal, "BLOCK_N": block_n, "HEAD_DIM": head_dim, "STAGES": stages,
                              "PINGPONG": pingpong, "CONSUMER_REGS": gluon.CONSUMER_REGS}  # fmt: skip
                cases.append(AotCase("openkernels.attention.core.gluon.kernels:attn_fwd_kernel", signature,
                                     constexprs, num_warps=4, options={"maxnreg": gluon.MAX_REGS},
                                     label=f"gluon_attn_fwd[D{head_dim},{dtype},causal={causal},pingpong={pingpong}]"))  # fmt: skip
    cases += _bwd_cases()
    return cases


def _bwd_cases() -> list:
    from openkernels.attention.core import gluon
    from openkernels.shared.dev.testing.aot import AotCase

    kernels = "openkernels.attention.core.gluon.kernels_bwd"
    scalars = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "seqlen_q": "i32", "seqlen_k": "i32", "group": "i32",
               "stride_lb": "i32", "stride_lh": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
    options = {"maxnreg": gluon.MAX_REGS}
    cases = []
    for d in gluon.HEAD_DIMS:
        q_rows, kv_stages, block_n, q_stages = gluon.bwd_config(d)
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                rows = _desc(dtype, [1, gluon.ROWS, d])
                dkdv = {"k_desc": rows, "v_desc": rows, "q_desc": _desc(dtype, [1, q_rows, d]),
                        "do_desc": _desc(dtype, [1, q_rows, d]), "dk_ptr": f"*{dtype}", "dv_ptr": f"*{dtype}",
                        "heads_kv": "i32", "stride_kb": "i64", "stride_ks": "i32", **scalars}  # fmt: skip
                dq = {"q_desc": rows, "do_desc": rows, "k_desc": _desc(dtype, [1, block_n, d]),
                      "v_desc": _desc(dtype, [1, block_n, d]), "dq_ptr": f"*{dtype}", "heads": "i32",
                      "stride_qb": "i64", "stride_qs": "i32", **scalars}  # fmt: skip
                common = {"CAUSAL": causal, "D": d, "CONSUMER_REGS": gluon.CONSUMER_REGS}
                tag = f"D{d},{dtype},causal={causal}"
                cases.append(AotCase(f"{kernels}:attn_bwd_dkdv_kernel", dkdv, {**common, "STAGES": kv_stages},
                                     num_warps=4, options=options, label=f"gluon_attn_bwd_dkdv[{tag}]"))  # fmt: skip
                cases.append(AotCase(f"{kernels}:attn_bwd_dq_kernel", dq,
                                     {**common, "BLOCK_N": block_n, "STAGES": q_stages}, num_warps=4,
                                     options=options, label=f"gluon_attn_bwd_dq[{tag}]"))  # fmt: skip
    return cases
