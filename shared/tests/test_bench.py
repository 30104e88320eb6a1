"""The benchmark harness on CPU: timing, byte accounting, peers side by side, JSON."""

from __future__ import annotations

import json

import torch

from openkernels.shared.bench import BenchCase, format_table, run_cases, score, time_ms, write_json


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
    from openkernels.shared import bench

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
