"""What the peer benchmarks over a family's bench cases (run.py, quant_linear.py,
decode_attention.py) share: their common options, option lists, and one timed run printed
as a table. The scripts import it by its bare name, as they import each other."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from openkernels.shared.dev.bench import Measurement, format_table, run_cases


def parser() -> argparse.ArgumentParser:
    """A parser with --device: cuda where there is one, else cpu."""
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def add_run_options(p: argparse.ArgumentParser) -> None:
    """--rep-ms (time per contender), --json (where to write the results), --kernel-time."""
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--json", default="")
    p.add_argument("--kernel-time", action="store_true", help="also report device time in kernels")


def names(text: str) -> list[str]:
    """A comma-separated option: "sdpa,flex" -> ["sdpa", "flex"]; "" -> []."""
    return [name for name in text.split(",") if name]


def shapes(text: str) -> list[tuple[int, ...]]:
    """--shapes: "8192x8192,28672x8192" -> [(8192, 8192), (28672, 8192)]."""
    return [tuple(int(n) for n in shape.split("x")) for shape in names(text)]


def run_and_print(cases: Sequence[Any], device: torch.device, args: argparse.Namespace,
                  **ceilings: float) -> list[Measurement]:  # fmt: skip
    """Time `cases` with the run options in `args`, print the table, return the measurements."""
    results = run_cases(cases, device, rep_ms=args.rep_ms, kernel_time=args.kernel_time, **ceilings)
    print(format_table(results, **ceilings), flush=True)
    return results
