"""benchmarks/asv_history.py's regression rule: a time is a regression past its family's
factor, or past NOISE_MARGIN times the spread measured for it on the machine (repeated runs of
one commit), whichever is larger; a benchmark the base had and the head lost is one too."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def history(script):
    return script("asv_history")


def _compare(history, monkeypatch, before: dict, after: dict, noise: dict) -> list[str]:
    results = {"base": before, "head": after}
    monkeypatch.setattr(history, "load_results", lambda machine, sha: results[sha])
    monkeypatch.setattr(history, "load_noise", lambda machine: noise)
    return history.compare("m", "base", "head", dict(history.FACTORS))


def test_a_rise_past_the_factor_is_a_regression_unless_the_machine_is_that_noisy(
    history, monkeypatch
) -> None:
    key = ("layernorm.Norms.track_ms", "'rms_norm', 'bfloat16'")
    name = f"{key[0]}({key[1]})"
    base, head = {key: 1.0}, {key: 1.2}
    assert len(_compare(history, monkeypatch, base, head, {})) == 1  # 1.2x > 1.10
    assert _compare(history, monkeypatch, base, head, {name: 1.5}) == []  # inside 1.1 x 1.5
    slower = _compare(history, monkeypatch, base, {key: 1.8}, {name: 1.5})
    assert len(slower) == 1 and "limit 1.65x" in slower[0]
    assert _compare(history, monkeypatch, base, {key: 1.05}, {}) == []


def test_a_benchmark_lost_at_head_is_a_regression(history, monkeypatch) -> None:
    key = ("quant.Int4Linear.track_ms", "'1x4096x4096'")
    lost = _compare(history, monkeypatch, {key: 1.0}, {}, {})
    assert len(lost) == 1 and "missing at head" in lost[0]


def test_throughput_is_not_judged(history, monkeypatch) -> None:
    key = ("layernorm.Norms.track_gbps", "'rms_norm'")
    assert _compare(history, monkeypatch, {key: 100.0}, {key: 10.0}, {}) == []


def test_markdown_report_lists_the_regressions_and_every_time(history, monkeypatch) -> None:
    slow = ("layernorm.Norms.track_ms", "'rms_norm'")
    same = ("activations.Act.track_ms", "'silu'")
    results = {"base": {slow: 1.0, same: 2.0}, "head": {slow: 1.5, same: 2.0}}
    monkeypatch.setattr(history, "load_results", lambda machine, sha: results[sha])
    monkeypatch.setattr(history, "load_noise", lambda machine: {})
    rows, regressions = history.compare_rows("m", "base", "head", dict(history.FACTORS))
    text = history.markdown_report("m", "base0000", "head0000", rows, regressions)
    assert "**1 regression(s)**" in text and "layernorm.Norms.track_ms(" in text.splitlines()[2]
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[1].startswith("| slower | `layernorm.Norms('rms_norm')` | 1 | 1.5 | 1.50x | 1.10x |")
    assert table[2].startswith("|  | `activations.Act('silu')` | 2 | 2 | 1.00x |")
    clean = history.markdown_report("m", "b", "h", rows[1:], [])
    assert "no regression" in clean.splitlines()[0]


def test_noise_stops_at_its_budget_and_keeps_the_runs_it_made(history, monkeypatch, tmp_path) -> None:
    """A noise run cut by its budget still writes the spread of the runs it finished (at
    least two), and starts no run after the budget."""
    times = iter([1.0, 1.3, 1.1, 9.9])
    current: dict = {}
    clock = iter([0.0, 5.0, 50.0, 500.0])  # start, then before runs 3 and 4

    def run_commit(sha, **kwargs):
        current[("attention.Decode.track_ms", "'x'")] = next(times)

    monkeypatch.setattr(history, "git", lambda *args: "abc")
    monkeypatch.setattr(history, "run_commit", run_commit)
    monkeypatch.setattr(history, "load_results", lambda machine, sha: dict(current))
    monkeypatch.setattr(history, "NOISE", tmp_path)
    monkeypatch.setattr(history.time, "monotonic", lambda: next(clock))
    data = history.measure_noise("m", 4, ".*", "spawn", budget_s=40.0)
    assert data["runs"] == 3
    assert data["spread"] == {"attention.Decode.track_ms('x')": pytest.approx(1.3)}
    assert (tmp_path / "m.json").exists()
