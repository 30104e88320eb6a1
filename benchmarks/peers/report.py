"""Markdown tables from benchmarks/peers/run.py JSON, for docs/perf.md.

    python benchmarks/peers/report.py bench.json [more.json ...]

One row per case: our time and GB/s (TFLOP/s for compute-bound cases such as attention),
the ratio to the ceiling measured in the same run (device copy, or bf16 matmul), the
same-size copy for memory-bound cases, and each peer's time as a multiple of ours (> 1: we
are faster).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for m in data["results"]:
        rows[(m["op"], m["direction"], "x".join(map(str, m["shape"])), m["dtype"])][m["contender"]] = m
    peers = sorted({c for r in rows.values() for c in r} - {"ours", "copy"})
    meta = data["meta"]
    compute = any(m.get("flops") for m in data["results"])
    where = f"({meta.get('device', '')}, torch {meta.get('torch', '')})"
    if compute:
        head = f"bf16 matmul ceiling in this run: {meta['ceiling_tflops']:.3g} TFLOP/s {where}."
    else:
        head = f"Device copy ceiling in this run: {meta['ceiling_gbps']:.0f} GB/s {where}."
    unit = "TFLOP/s" if compute else "GB/s"
    lines = [
        head,
        "",
        f"| op | dir | shape | dtype | ours ms | {unit} | / ceiling | same-size copy | "
        + " | ".join(f"{p} (x ours)" for p in peers)
        + " |",
        "|" + "---|" * (8 + len(peers)),
    ]
    for (op, direction, shape, dtype), r in rows.items():
        ours = r.get("ours")
        if not ours:
            continue
        copy = r.get("copy")
        cells = [
            op,
            direction,
            shape,
            dtype,
            f"{ours['ms']:.4f}",
            f"{ours['tflops']:.3g}" if compute else f"{ours['gbps']:.0f}",
            f"{ours['ratio_to_ceiling']:.3f}",
            f"{copy['ratio_to_ceiling']:.3f}" if copy else "",
        ]
        for p in peers:
            m = r.get(p)
            cells.append("" if not m or m["error"] else f"{m['ms']:.4f} ({m['ms'] / ours['ms']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
        print()
