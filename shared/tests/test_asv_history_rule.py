"""benchmarks/asv_history.py's history rule on synthetic committed histories: a benchmark is
flagged when the minimum of its last WINDOW results exceeds its best earlier result by more
than max(family factor, MARGIN x its measured spread), at the first commit of the lasting rise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NORM = "layernorm.LayerNorm.track_ms"
PARAMS = [["'rms_norm'"], ["'fwd'"]]
LABEL = "'rms_norm', 'fwd'"
KEY = f"{NORM}({LABEL})"


@pytest.fixture()
def history(script):
    return script("asv_history")


def _sha(i: int) -> str:
    return f"{i:02x}" * 20


def _write(results: Path, machine: str, times: dict[str, list[float]]) -> None:
    """One asv result file per commit, commit i dated i hours after the first; a NaN is a failure."""
    folder = results / machine
    folder.mkdir(parents=True)
    (folder / "machine.json").write_text(json.dumps({"machine": machine, "version": 1}))
    for i in range(max(len(v) for v in times.values())):
        rows = {name: [[values[i]], PARAMS, "1", 0, 1.0] for name, values in times.items() if i < len(values)}
        data = {"commit_hash": _sha(i), "date": 1_700_000_000_000 + i * 3_600_000, "version": 2,
                "result_columns": ["result", "params", "version", "started_at", "duration"],
                "results": rows, "params": {"machine": machine}}  # fmt: skip
        (folder / f"{_sha(i)[:8]}-existing-py.json").write_text(json.dumps(data))


def _run(history, monkeypatch, tmp_path: Path, times: list[float], noise: dict[str, float] | None = None):
    monkeypatch.setattr(history, "load_noise", lambda machine: noise or {})
    _write(tmp_path, "m", {NORM: times})
    return history.history("m", results=tmp_path)


def test_a_step_is_flagged_at_the_commit_where_it_happened(history, monkeypatch, tmp_path) -> None:
    found, judged = _run(history, monkeypatch, tmp_path, [1.0, 1.02, 0.98, 1.01, 1.5, 1.48, 1.52, 1.51])
    assert judged == 1 and len(found) == 1
    regression = found[0]
    assert regression.benchmark == KEY
    assert regression.step.commit == _sha(4) and regression.before.commit == _sha(3)
    assert regression.best.commit == _sha(2) and regression.rise == pytest.approx(1.48 / 0.98)
    assert regression.limit == pytest.approx(1.10)
    assert "step at 04040404" in history.describe(regression, 3)


def test_a_step_within_the_last_window_is_flagged_there(history, monkeypatch, tmp_path) -> None:
    found, _ = _run(history, monkeypatch, tmp_path, [1.0, 1.0, 1.0, 1.0, 1.3, 1.3, 1.3])
    assert [r.step.commit for r in found] == [_sha(4)]


def test_a_noisy_but_flat_history_is_not_flagged(history, monkeypatch, tmp_path) -> None:
    times = [1.0, 1.6, 1.05, 1.3, 1.55, 1.08, 1.4, 1.02, 1.5, 1.06]
    assert _run(history, monkeypatch, tmp_path, times)[0] == []
    # A noisy machine's rises within its measured spread are no regression either.
    noisy = [1.0, 2.0, 1.1, 1.9, 1.5, 1.5, 1.6]
    assert _run(history, monkeypatch, tmp_path / "noisy", noisy, {KEY: 1.6})[0] == []


def test_a_single_slow_outlier_is_not_flagged(history, monkeypatch, tmp_path) -> None:
    for i, times in enumerate(([1.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0])):
        assert _run(history, monkeypatch, tmp_path / str(i), times)[0] == []


def test_the_measured_spread_sets_the_limit_and_its_absence_the_family_factor(
    history, monkeypatch, tmp_path
) -> None:
    times = [1.0, 1.0, 1.0, 1.0, 1.4, 1.4, 1.4]
    found, _ = _run(history, monkeypatch, tmp_path / "a", times)  # no noise entry: layernorm's 1.10
    assert len(found) == 1 and found[0].limit == pytest.approx(1.10)
    assert _run(history, monkeypatch, tmp_path / "b", times, {KEY: 1.5})[0] == []  # limit 1.65
    found, _ = _run(history, monkeypatch, tmp_path / "c", [*times[:4], 2.0, 2.0, 2.0], {KEY: 1.5})
    assert len(found) == 1 and found[0].limit == pytest.approx(1.65)
    assert history.history_limit("quant.Int4Linear.track_ms('int4')", {}, history.FACTORS, 1.1) == 1.15
    assert history.history_limit("host_time.HostTime.track_ms('gelu')", {}, history.FACTORS, 1.1) == 1.10


def test_short_histories_failures_and_old_versions_are_left_out(history, monkeypatch, tmp_path) -> None:
    assert _run(history, monkeypatch, tmp_path / "a", [1.0, 2.0, 2.0]) == ([], 0)  # window + 1 needed
    found, _ = _run(history, monkeypatch, tmp_path / "b", [1.0, 1.0, 1.0, float("nan"), 1.0, 1.0, 1.0])
    assert found == []
    series = {"x": [(history.Point(i, _sha(i), 1.0 + (i < 3)), "1" if i < 3 else "2") for i in range(6)]}
    assert [p.value for p in history._newest_version(series["x"])] == [1.0, 1.0, 1.0]


def test_results_are_ordered_by_commit_date_not_file_name(history, tmp_path) -> None:
    _write(tmp_path, "m", {NORM: [1.0, 2.0, 3.0]})
    first = tmp_path / "m" / f"{_sha(0)[:8]}-existing-py.json"
    data = json.loads(first.read_text())
    data["date"] += 10 * 3_600_000  # the first file's commit is now the newest
    first.write_text(json.dumps(data))
    assert [p.value for p in history.load_series("m", tmp_path)[KEY]] == [2.0, 3.0, 1.0]


def test_the_command_exits_1_on_a_regression(history, monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(history, "load_noise", lambda machine: {})
    monkeypatch.setattr(history, "RESULTS", tmp_path)
    _write(tmp_path, "flat", {NORM: [1.0] * 5})
    _write(tmp_path, "slow", {NORM: [1.0, 1.0, 2.0, 2.0, 2.0]})
    assert history.history_machines(tmp_path) == ["flat", "slow"]
    assert history.main(["history", "--machine", "flat"]) == 0
    assert history.main(["history", "--machine", "slow", "--window", "2"]) == 1
    assert "step at 02020202" in capsys.readouterr().out
