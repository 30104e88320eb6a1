"""Host time per call of every public op on tiny inputs, against its closest torch eager op.

    python -m benchmarks.peers.host_time [--device cuda] [--ops rms_norm,attention] [--json PATH]
                                   [--direct-launch both]

Prints one row per (op, direction): our public call and the torch op in microseconds per
call (median of alternated rounds, with their range), and the ratio (the op-layer issue's
bar: <= 1.0). The cases are those of the asv suite (benchmarks/asv_suite/host_time.py).
--direct-launch both runs the table twice, with Triton's own launch path and with
openkernels.shared.launch's direct one (GPU only), to show what the direct launch saves.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from benchmarks.asv_suite import host_time as H


def _table(dev: torch.device, ops: tuple[str, ...], calls: int, rounds: int) -> list[dict]:
    rows = []
    found = H.cases(dev, ops=ops)
    for (op, direction), runs in H.measure(found, dev, calls=calls, rounds=rounds).items():
        case = next(c for c in found if (c.op, c.direction) == (op, direction))
        row = {"op": op, "direction": direction, "torch_op": case.torch_name, **H.summary(runs),
               "ours_range": [min(runs["ours"]), max(runs["ours"])],
               "torch_range": [min(runs["torch"]), max(runs["torch"])]}  # fmt: skip
        rows.append(row)
        print(f"{op:<38} {direction:<8} {row['ours_us']:8.1f} us [{row['ours_range'][0]:.1f}-{row['ours_range'][1]:.1f}]"
              f"  {row['torch_us']:7.1f} us [{row['torch_range'][0]:.1f}-{row['torch_range'][1]:.1f}]"
              f"  {row['ratio']:5.2f}x  ({case.torch_name})", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ops", default=",".join(H.OPS), help="comma-separated ops (default: all)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--direct-launch", choices=("on", "off", "both"), default="on")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    dev = torch.device(args.device)
    ops = tuple(o for o in args.ops.split(",") if o)
    from openkernels.shared import launch

    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "tables": {}}  # fmt: skip
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.direct_launch]
    for fast in modes:
        launch.FAST = fast
        print(f"\n{dev} ({report['device']}), direct launch {'on' if fast else 'off'}; "
              f"op, direction, ours [range], torch [range], ours/torch")  # fmt: skip
        report["tables"]["direct" if fast else "triton"] = _table(dev, ops, args.calls, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
