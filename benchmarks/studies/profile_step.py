"""Where the time of one forward+backward step goes: host time per step and per-kernel GPU
time (torch.profiler), for ours and the peers, on one layernorm shape.

    python benchmarks/studies/profile_step.py [--op rms_norm] [--shape 32768x2048]
"""

from __future__ import annotations

import argparse
import time

import torch

from openkernels.layernorm import bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", default="rms_norm")
    parser.add_argument("--shape", default="32768x2048")
    args = parser.parse_args()
    rows, n = (int(v) for v in args.shape.split("x"))
    dev = torch.device("cuda")
    (case,) = bench.cases(dev, shapes=[(rows, n)], ops=[args.op], directions=["fwd+bwd"])
    inputs = case.make_inputs(dev)
    for name, fn in case.contenders.items():
        s = case.setup[name](inputs) if name in case.setup else inputs
        for _ in range(3):
            fn(s)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn(s)
        host = (time.perf_counter() - start) / 20 * 1e6
        torch.cuda.synchronize()
        synced = (time.perf_counter() - start) / 20 * 1e6
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(s)
            torch.cuda.synchronize()
        kernels = sorted(
            ((e.key, e.device_time_total / 5) for e in prof.key_averages() if e.device_time_total > 0),
            key=lambda kv: -kv[1],
        )
        gpu = sum(t for _, t in kernels)
        print(f"{name:14s} host {host:7.1f} us/step  host+sync {synced:7.1f}  gpu {gpu:7.1f} us/step")
        for key, t in kernels[:6]:
            print(f"    {t:8.1f} us  {key[:90]}")


if __name__ == "__main__":
    main()
