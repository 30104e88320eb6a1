"""Which launcher each linear call of the 1B decode step runs on tiled codes (quant 0.10.15's
Int4Linear(layout="tiled")): ops.tiled_runner's answer per (codes shape, rows of x, x
contiguous), over one eager step after the prefill, and every warning the step raised. The
tiled step was 0.08 ms slower than the rows one in a CUDA graph on an H100 with bitwise the
same logits (twenty-fourth session): a layer whose codes are converted per call would do that.
The census found every call on the tensor-core GEMV; reading the code then found the copies:
kernelize's attention read the q / k projections' `weight` property, which builds the 4-bit
weight (attention 0.8.12 reads out_features). The aten-op census (added after) lists what a
step's Python path runs that copies or computes.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src):benchmarks/peers \\
        python3 benchmarks/studies/quant_tiled_census.py [--context 4096]
"""

from __future__ import annotations

import argparse
import collections
import copy
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from e2e_decode_step import _caches, _step_runner
from e2e_kv_decode import build
from e2e_models import LLAMA_1B
from openkernels.quant import ops
from openkernels.shared.kernelize import kernelize


class _AtenCensus(TorchDispatchMode):
    """Counts the aten ops a step runs that copy or compute (views and allocations left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not any(v in name for v in ("view", "empty", "slice", "select", "expand", "t.default", "unsqueeze",
                                       "transpose", "permute", "detach", "alias", "_unsafe_view", "as_strided")):  # fmt: skip
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.ops[(name, shapes)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = copy.deepcopy(build(LLAMA_1B, device))
    kernelize(model, quantize={"kind": "int4", "skip": (), "layout": "tiled"})
    tally: collections.Counter = collections.Counter()
    runner = ops.tiled_runner

    def spy(x, tiled, *rest):
        chosen = runner(x, tiled, *rest)
        tally[(tuple(tiled.shape), x.shape[:-1].numel(), x.is_contiguous(), x.data_ptr() % 16, chosen)] += 1
        return chosen

    ops.tiled_runner = spy
    cache = _caches(model, "ours-int4-head", args.context + 64, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = _step_runner(model, cache, args.context, device)
        tally.clear()  # the prefill's calls: many rows, not the step's
        step()
        torch.cuda.synchronize()
        census = _AtenCensus()
        with census:
            step()
        torch.cuda.synchronize()
    for (shape, rows, contiguous, misalign, chosen), count in sorted(tally.items(), key=str):
        print(f"codes {shape} rows {rows} contiguous {contiguous} ptr%16 {misalign}: {chosen} x{count}")
    for (name, shapes), count in sorted(census.ops.items(), key=str):
        print(f"aten {name} {shapes}: x{count}")
    for w in caught:
        print("warning:", str(w.message)[:300])


if __name__ == "__main__":
    main()
