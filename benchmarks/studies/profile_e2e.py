"""Where the time of a Llama-style 1B prefill / training step goes, unmodified vs kernelized
(torch.profiler CUDA kernel time grouped by kernel name; H200).

    python benchmarks/studies/profile_e2e.py [--part prefill|train] [--top 18]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# e2e_models lives with the peer benchmarks and is imported by its bare name, as they do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "peers"))
from e2e_models import LLAMA_1B, build
from openkernels.shared.kernelize import kernelize, unkernelize


def profile(fn, top: int) -> None:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in rows)
    print(f"  total kernel time {total / 1e3:.2f} ms")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="prefill,train")
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    model = build()
    for part in args.part.split(","):
        if part == "prefill":
            ids = torch.randint(0, LLAMA_1B["vocab_size"], (8, 2048), device="cuda")

            def fn(ids=ids):
                with torch.no_grad():
                    model(ids, use_cache=False, logits_to_keep=1)
        else:
            ids = torch.randint(0, LLAMA_1B["vocab_size"], (4, 2048), device="cuda")
            model.train()

            def fn(ids=ids):
                model.zero_grad(set_to_none=True)
                model(ids, labels=ids, use_cache=False).loss.backward()

        for label in ("sdpa", "kernelized"):
            if label == "kernelized":
                kernelize(model, mode="training" if part == "train" else "inference")
            print(f"== {part} {label}")
            profile(fn, args.top)
        unkernelize(model)
        model.eval()


if __name__ == "__main__":
    main()
