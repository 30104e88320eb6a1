"""benchmarks/docs_tables.py: the committed docs/results pages are what the committed asv
results generate (a results update without regenerated pages fails here), and the tables'
rows carry each number with its machine, commit date and short hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARAMS = [["'silu'", "'gelu'"], ["'fwd'", "'bwd'"]]


@pytest.fixture()
def tables(script):
    return script("docs_tables")


def test_committed_pages_match_the_committed_results(tables, capsys) -> None:
    assert tables.main(["--check"]) == 0, capsys.readouterr().out


def _benchmarks(results: Path) -> None:
    track = {"type": "track", "param_names": ["op", "direction"], "params": PARAMS, "version": "1"}
    data = {
        "activations.Activations.track_ms": {**track, "unit": "ms"},
        "activations.Activations.track_gbps": {**track, "unit": "GB/s"},
        "host_time.HostTime.track_ms": {"type": "track", "unit": "ms", "param_names": [], "params": [],
                                        "version": "h1"},
        "_harness.Suite.track_ms": {"type": "track", "unit": "ms", "version": "1"},
        "version": 2,
    }  # fmt: skip
    results.mkdir(parents=True)
    (results / "benchmarks.json").write_text(json.dumps(data))


def _result(results: Path, machine: str, sha: str, day: int, rows: dict) -> None:
    folder = results / machine
    folder.mkdir(exist_ok=True)
    (folder / "machine.json").write_text(json.dumps({"machine": machine, "version": 1}))
    data = {"commit_hash": sha, "date": 1_764_460_800_000 + day * 86_400_000, "version": 2,  # 2025-11-30
            "result_columns": ["result", "params", "version"], "results": rows}  # fmt: skip
    (folder / f"{sha[:8]}-existing-py.json").write_text(json.dumps(data))


@pytest.fixture()
def synthetic(tmp_path: Path) -> Path:
    results = tmp_path / "asv"
    _benchmarks(results)
    nan = float("nan")
    _result(results, "gpu", "a" * 40, 0, {
        "activations.Activations.track_ms": [[1.0, 2.0, 3.0, 4.0], PARAMS, "1"],
        "activations.Activations.track_gbps": [[10.0, 20.0, 30.0, 40.0], PARAMS, "1"],
        "host_time.HostTime.track_ms": [0.0125, [], "h1"],
    })  # fmt: skip
    _result(results, "gpu", "b" * 40, 1, {  # newer: silu fwd re-measured, gelu bwd failed
        "activations.Activations.track_ms": [[0.5, nan, nan, None], PARAMS, "1"],
        "activations.Activations.track_gbps": [[50.0, nan, nan, None], PARAMS, "1"],
        "host_time.HostTime.track_ms": [0.25, [], "h0"],  # an older version of the benchmark: ignored
    })  # fmt: skip
    _result(results, "cpu", "c" * 40, 2, {"activations.Activations.track_ms": [[12345.678, nan], [["'silu'"], ["'fwd'", "'bwd'"]], "1"]})  # fmt: skip
    return results


def test_rows_carry_the_number_and_its_machine_date_and_commit(tables, synthetic) -> None:
    pages = tables.render(synthetic)
    assert sorted(pages) == ["activations.md", "host_time.md"]
    lines = pages["activations.md"].splitlines()
    assert lines[0] == tables.MARKER and "python benchmarks/docs_tables.py" in lines[0]
    start = lines.index("| op | direction | machine | time (ms) | GB/s | date | commit |")
    assert lines[start + 2 :] == [
        "| silu | fwd | cpu | 1.235e+04 | - | 2025-12-02 | cccccccc |",
        "| silu | fwd | gpu | 0.5 | 50 | 2025-12-01 | bbbbbbbb |",
        "| silu | bwd | gpu | 2 | 20 | 2025-11-30 | aaaaaaaa |",
        "| gelu | fwd | gpu | 3 | 30 | 2025-11-30 | aaaaaaaa |",
        "| gelu | bwd | gpu | 4 | 40 | 2025-11-30 | aaaaaaaa |",
    ]
    host = pages["host_time.md"].splitlines()
    assert "# Benchmark results: Host time per call" in host
    assert host[-1] == "| gpu | 0.0125 | 2025-11-30 | aaaaaaaa |"


def test_check_mode_fails_on_stale_missing_or_orphaned_pages(tables, synthetic, tmp_path, capsys) -> None:
    out = tmp_path / "pages"
    args = ["--results", str(synthetic), "--out", str(out)]
    assert tables.main([*args, "--check"]) == 1  # nothing written yet
    assert tables.main(args) == 0
    assert tables.main([*args, "--check"]) == 0
    (out / "activations.md").write_text("typed by hand\n")
    (out / "old.md").write_text(tables.MARKER + "\n")
    (out / "notes.md").write_text("not generated\n")
    capsys.readouterr()
    assert tables.main([*args, "--check"]) == 1
    assert "activations.md" in capsys.readouterr().out
    assert tables.stale(tables.render(synthetic), out) == ["activations.md", "old.md"]
    assert tables.main(args) == 0
    assert not (out / "old.md").exists() and (out / "notes.md").exists()
    assert tables.main([*args, "--check"]) == 0
