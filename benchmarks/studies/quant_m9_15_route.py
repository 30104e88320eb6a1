"""9-15 rows of x at N >= 12288 with scales in x's dtype (the models' default): the gemv
launcher handed these calls to wgmma, which takes 16 rows and more, so they ran Triton's
kernel; since quant 0.10.15 they run the tensor-core GEMV. Kernel time (CUDA graph of the
public op) of the default against Triton forced, bf16, group 128, one sm_90 GPU:

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_m9_15_route.py
"""

from __future__ import annotations

import torch
from torch import nn

from openkernels.quant import Int4Linear
from openkernels.shared import dispatch
from openkernels.shared.dev.bench import rotating_graph_ms


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    for n, k in ((28672, 8192), (14336, 4096)):
        linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        layers = [Int4Linear.from_linear(linear) for _ in range(3)]  # bfloat16 scales (the weight's dtype)
        for m in (9, 12, 15):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            calls = [lambda layer=layer, x=x: layer(x) for layer in layers]
            with torch.no_grad():
                default = rotating_graph_ms(calls, 20)
                with dispatch.force("int4_linear:triton"):
                    triton = rotating_graph_ms(calls, 20)
                want = layers[0](x)
                with dispatch.force("int4_linear:triton"):
                    got = layers[0](x)
            print(
                f"{n}x{k} M={m}: default {default * 1e3:.1f} us, Triton {triton * 1e3:.1f} us, "
                f"max |diff| {(want.float() - got.float()).abs().max().item():.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
