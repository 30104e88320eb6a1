"""Host time of one decoder layer call (Llama-style, hidden 64, one token, no cache, CPU, one
thread: the work is negligible, so this is Python and dispatch): transformers' layer, the
kernelized layer without the add + norm fusion (the layer itself left by kernelize's skip) and
with it. Medians of 7 timings of 2000 calls.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python benchmarks/studies/decoder_layer_host_time.py
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import transformers

from openkernels.shared.kernelize import kernelize


def main() -> None:
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    fused = copy.deepcopy(base)
    kernelize(fused)
    plain = copy.deepcopy(base)
    kernelize(plain, skip=["model.layers.?"])
    x = torch.randn(1, 1, 64)
    cos_sin = base.model.rotary_emb(x, position_ids=torch.zeros(1, 1, dtype=torch.long))
    layers = {
        "transformers": base.model.layers[0],
        "kernelized, unfused": plain.model.layers[0],
        "kernelized, fused": fused.model.layers[0],
    }

    def mean_us(layer, n: int = 2000) -> float:
        for _ in range(200):
            layer(x, position_embeddings=cos_sin)
        t0 = time.perf_counter()
        for _ in range(n):
            layer(x, position_embeddings=cos_sin)
        return (time.perf_counter() - t0) / n * 1e6

    with torch.no_grad():
        times: dict[str, list[float]] = {k: [] for k in layers}
        for _ in range(7):  # alternated, so a slow phase of the machine hits every variant
            for name, layer in layers.items():
                times[name].append(mean_us(layer))
    for name, v in times.items():
        print(f"{name:24s} {statistics.median(v):7.1f} us per layer call (range {min(v):.1f}-{max(v):.1f})")


if __name__ == "__main__":
    main()
