"""The benchmark harness on CPU: timing, byte accounting, peers side by side, JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from openkernels.shared.dev import bench
from openkernels.shared.dev.bench import (
    BenchCase,
    format_table,
    matmul_ceiling_tflops,
    run_cases,
    score,
    time_ms,
    write_json,
)


def _case() -> BenchCase:
    n = 1 << 16
    return BenchCase(
        family="demo",
        op="scale",
        direction="fwd",
        shape=(n,),
        dtype=torch.float32,
        bytes=2 * 4 * n,
        make_inputs=lambda device: {"x": torch.randn(n, device=device)},
        contenders={"ours": lambda s: s["x"] * 2.0, "broken": lambda s: 1 / 0},
    )


def test_time_ms_is_positive_and_median() -> None:
    ms = time_ms(lambda s: s["x"].sum(), [{"x": torch.randn(1000)}], torch.device("cpu"), rep_ms=5)
    assert 0 < ms < 1000


def test_run_cases_reports_every_contender_and_errors(tmp_path) -> None:
    results = run_cases([_case()], "cpu", ceiling_gbps=10.0, rep_ms=5)
    by_name = {m.contender: m for m in results}
    assert set(by_name) == {"ours", "broken", "copy"}
    ours = by_name["ours"]
    assert ours.gbps > 0 and abs(ours.ratio_to_ceiling - ours.gbps / 10.0) < 1e-9
    assert "ZeroDivisionError" in by_name["broken"].error
    table = format_table(results, ceiling_gbps=10.0)
    assert "scale fwd" in table and "error" in table
    path = tmp_path / "out.json"
    write_json(results, str(path), ceiling_gbps=10.0)
    data = json.loads(path.read_text())
    assert data["meta"]["ceiling_gbps"] == 10.0 and len(data["results"]) == 3


def test_score_flags_errors_and_nan() -> None:
    ref = torch.randn(100, dtype=torch.float64)
    assert score(ref.to(torch.bfloat16), ref, torch.bfloat16)[1]
    assert not score((ref * 1.1).to(torch.bfloat16), ref, torch.bfloat16)[1]
    bad = ref.clone()
    bad[3] = float("nan")
    assert not score(bad, ref, torch.float64)[1]


def test_kernel_times_fill_in_after_the_wall_times(monkeypatch) -> None:
    # The second pass (CUDA only in run_cases) fills kernel_ms for contenders that ran and
    # leaves failed ones and the same-size copy alone; kernel_ms is stubbed: no GPU here.
    from openkernels.shared.dev import bench

    calls = []
    monkeypatch.setattr(bench, "kernel_ms", lambda fn, sets, device: calls.append(fn) or 0.25)
    case = _case()
    results = run_cases([case], "cpu", ceiling_gbps=10.0, rep_ms=5)
    assert all(m.kernel_ms == 0.0 for m in results)  # CPU: no second pass
    bench._add_kernel_times([case], results, torch.device("cpu"), None)
    by_name = {m.contender: m for m in results}
    assert by_name["ours"].kernel_ms == 0.25
    assert by_name["broken"].kernel_ms == 0.0 and by_name["copy"].kernel_ms == 0.0
    assert len(calls) == 1
    assert "0.2500" in format_table(results)


def _flop_case() -> BenchCase:
    n = 64
    return BenchCase(
        family="demo",
        op="matmul",
        direction="fwd",
        shape=(n, n, n),
        dtype=torch.float32,
        bytes=3 * 4 * n * n,
        make_inputs=lambda device: {
            "a": torch.randn(n, n, device=device),
            "b": torch.randn(n, n, device=device),
        },
        contenders={"ours": lambda s: s["a"] @ s["b"], "broken": lambda s: 1 / 0},
        flops=2 * n**3,
    )


def test_matmul_ceiling_is_quick_and_positive_on_cpu() -> None:
    assert matmul_ceiling_tflops("cpu", n=32) > 0
    assert matmul_ceiling_tflops("cpu", torch.float32, n=32) > 0


def test_flop_cases_report_tflops_against_the_matmul_ceiling(monkeypatch) -> None:
    # Only compute-bound cases: no copy ceiling is measured and no same-size copy runs;
    # the matmul ceiling is measured when not given (stubbed here).
    def no_copy(*args, **kwargs):
        raise AssertionError("the copy ceiling is not needed by flop cases")

    monkeypatch.setattr(bench, "copy_ceiling_gbps", no_copy)
    monkeypatch.setattr(bench, "matmul_ceiling_tflops", lambda device: 2e-3)
    results = run_cases([_flop_case()], "cpu", rep_ms=5)
    by_name = {m.contender: m for m in results}
    assert set(by_name) == {"ours", "broken"}
    ours = by_name["ours"]
    assert ours.flops == 2 * 64**3
    assert ours.tflops == pytest.approx(ours.flops / ours.ms / 1e9)
    assert ours.ratio_to_ceiling == pytest.approx(ours.tflops / 2e-3)
    assert "ZeroDivisionError" in by_name["broken"].error
    table = format_table(results)  # the ceiling is read back from the ratios
    assert "matmul ceiling: 0.0020 TFLOP/s" in table
    assert "TFLOP/s" in table.splitlines()[1] and "GB/s" not in table and "copy" not in table
    assert "matmul fwd 64x64x64" in table and "error" in table


def test_mixed_lists_print_both_tables(tmp_path) -> None:
    results = run_cases([_case(), _flop_case()], "cpu", ceiling_gbps=10.0, ceiling_tflops=1e-3, rep_ms=5)
    by_key = {(m.op, m.contender): m for m in results}
    assert set(by_key) == {(op, c) for op in ("scale", "matmul") for c in ("ours", "broken")} | {
        ("scale", "copy")
    }
    scale, matmul = by_key["scale", "ours"], by_key["matmul", "ours"]
    assert scale.flops == 0 and scale.ratio_to_ceiling == pytest.approx(scale.gbps / 10.0)
    assert matmul.ratio_to_ceiling == pytest.approx(matmul.tflops / 1e-3)
    matmul.kernel_ms = matmul.ms / 2  # as the CUDA second pass would fill it
    table = format_table(results, ceiling_gbps=10.0, ceiling_tflops=1e-3)
    lines = table.splitlines()
    assert lines[0] == "copy ceiling: 10 GB/s"
    gb_header = lines.index(next(line for line in lines if line.startswith("case") and "GB/s" in line))
    flop_line = lines.index("matmul ceiling: 0.0010 TFLOP/s")
    assert gb_header < flop_line and "TFLOP/s" in lines[flop_line + 1]
    # Every row sits in its own table, error rows included; then the timings' noise, of both.
    assert lines[-1].startswith("timing noise")
    assert all("matmul" not in line for line in lines[:flop_line])
    assert all("scale" not in line for line in lines[flop_line:-1])
    matmul_row = next(line for line in lines if line.startswith("matmul") and " ours " in line)
    assert f"{matmul.kernel_ms:8.4f}" in matmul_row and f"{2 * matmul.tflops:.4f}" in matmul_row
    path = tmp_path / "out.json"
    write_json(results, str(path), ceiling_gbps=10.0, ceiling_tflops=1e-3)
    data = json.loads(path.read_text())
    assert {r["flops"] for r in data["results"]} == {0, 2 * 64**3}


def test_byte_only_tables_keep_their_format() -> None:
    results = run_cases([_case()], "cpu", ceiling_gbps=10.0, rep_ms=5)
    lines = format_table(results, ceiling_gbps=10.0).splitlines()
    header = f"{'case':<46} {'contender':<14} {'ms':>9} {'GB/s':>8} {'ceil':>6}  vs ours  {'kern ms':>8} {'kern GB/s':>9}"
    assert lines[:3] == ["copy ceiling: 10 GB/s", header, "-" * len(header)]
    assert len(lines) == 4 + len(results) and not any("TFLOP/s" in line for line in lines)
    assert lines[-1].startswith("timing noise")  # CPU timings: their spread was measured


def test_copy_ceiling_on_cpu_is_the_best_of_many_copies() -> None:
    ceiling = bench.copy_ceiling("cpu", nbytes=4 * 2**20)
    assert 10 <= len(ceiling.repeats) <= 100 and ceiling.gbps == max(ceiling.repeats) > 0
    assert ceiling.buffer_bytes == 4 * 2**20 and ceiling.threads == torch.get_num_threads()
    text = ceiling.describe()
    best = f"copy ceiling: {ceiling.gbps:.1f} GB/s, the best of {len(ceiling.repeats)} copies of 2 x 4 MiB"
    assert text.startswith(best)
    assert f"{min(ceiling.repeats):.1f}-{ceiling.gbps:.1f} GB/s" in text and "last-level cache" in text
    assert bench.copy_ceiling_gbps("cpu", nbytes=2**20) > 0


def test_copy_ceiling_buffers_are_four_times_the_last_level_cache() -> None:
    mib = 2**20
    assert bench.last_level_cache_bytes() >= 2**10
    assert bench.stream_buffer_bytes(24 * mib) == 96 * mib
    assert bench.stream_buffer_bytes(1 * mib) == 64 * mib  # the least
    assert bench.stream_buffer_bytes(2**30) == 2**31  # the most
    assert bench.stream_buffer_bytes(24 * mib, free_bytes=200 * mib) == 50 * mib  # a quarter of the free
    assert bench.stream_buffer_bytes(24 * mib, free_bytes=mib) == 16 * mib


def test_the_table_says_how_noisy_the_timings_are() -> None:
    case = ("demo", "scale", "fwd", (8,), "float32")
    rows = [
        bench.Measurement(*case, name, 1.0, 1.0, 0.0, 0.1, "cpu", spread=spread)
        for name, spread in (("ours", 0.02), ("torch", 0.30), ("copy", 0.04))
    ]
    last = format_table(rows, ceiling_gbps=10.0).splitlines()[-1]
    assert last == (
        "timing noise (interquartile range of each row's timed calls / their median): median 4%, "
        "largest 30% (scale fwd 8 float32, torch)"
    )
    assert "timing noise" not in format_table([dataclasses.replace(m, spread=0.0) for m in rows])


def test_score_takes_a_derived_atol() -> None:
    ref = torch.zeros(10, dtype=torch.float64)
    off = ref + 1e-3
    assert not score(off, ref, torch.bfloat16)[1]
    error, ok = score(off, ref, torch.bfloat16, atol=2e-3)
    assert ok and error == pytest.approx(0.5)
