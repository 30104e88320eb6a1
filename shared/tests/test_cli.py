"""The `openkernels` command on CPU: env names what dispatch runs for every op, check turns
failures into exit code 1, bench writes JSON (and a plot, or a clear error without
matplotlib), demo hands over to model_demo. Benchmarks are shrunk to one tiny case."""

from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys
import types
from dataclasses import fields

import pytest
import torch

from openkernels.shared import dispatch
from openkernels.shared.dev import cli
from openkernels.shared.dev.bench import Check, Measurement

FAMILIES = cli.families()
pytestmark = pytest.mark.skipif(not FAMILIES, reason="no openkernels family installed")


def _family(name: str) -> str:
    if name not in FAMILIES:
        pytest.skip(f"openkernels.{name} is not installed")
    return name


@pytest.fixture
def tiny_layernorm(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """layernorm's cases cut to one 64 x 256 rms_norm forward; records the peers asked for."""
    bench = importlib.import_module(f"openkernels.{_family('layernorm')}.bench")
    real, asked = bench.cases, []

    def cases(device, *, peers=("torch", "torch.compile", "liger")):
        asked.append(tuple(peers))
        return real(device, shapes=((64, 256),), ops=("rms_norm",), directions=("fwd",), peers=peers)

    monkeypatch.setattr(bench, "cases", cases)
    return asked


def test_env_names_an_implementation_for_every_registered_op(capsys: pytest.CaptureFixture[str]) -> None:
    key_fns = {op: entry.key_fn for op, entry in dispatch._OPS.items()}
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^torch +{re.escape(torch.__version__)} ", out, re.MULTILINE)
    for family in FAMILIES:
        assert f"  {family}" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("family") and "not picked: why" in line)
    start = lines.index(header)
    runs_at, op_at = header.index("runs"), header.index("op")
    table = {}
    for line in lines[start + 2 :]:
        if not line.strip() or line.startswith("inputs:"):
            break
        table[line[op_at:].split()[0]] = line[runs_at:].split()[0]
    assert set(table) == set(dispatch._OPS)  # every registered op has its row
    for op, runs in table.items():
        assert runs in {i.name for i in dispatch.implementations(op)}, (op, runs)
    if "silu_and_mul" in table:  # the table agrees with what a bfloat16 CPU call selects
        key = dispatch.key_for(torch.empty(0, dtype=torch.bfloat16))
        assert table["silu_and_mul"] == dispatch.select("silu_and_mul", key)[0].name
    assert {op: entry.key_fn for op, entry in dispatch._OPS.items()} == key_fns  # unwrapped again


def test_check_passes_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    family = _family("quant")  # the quickest checks
    assert cli.main(["check", family, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "FAIL" not in out
    assert "int4_linear[int4] M=1" in out


@pytest.mark.parametrize("how", ["fails", "raises"])
def test_check_failure_exits_1(how: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    family = _family("quant")
    bench = importlib.import_module(f"openkernels.{family}.bench")

    def checks(device):
        if how == "raises":
            raise RuntimeError("kernel exploded")
        return [
            Check("good_op", "fwd", "cpu", "bfloat16", 0.5, True),
            Check("bad_op", "fwd", "cpu", "bfloat16", 3.0, False),
        ]

    monkeypatch.setattr(bench, "checks", checks)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the fallback one-line counter
    assert cli.main(["check", family, "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    assert "check 1/1" in captured.err
    if how == "fails":
        assert "FAILED cpu quant bad_op fwd cpu: error/tol 3.000" in captured.out
        assert "1 of 2 checks FAILED" in captured.out
    else:
        assert "RuntimeError: kernel exploded" in captured.out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "no_such_family"]) == 2
    assert "unknown family no_such_family" in capsys.readouterr().err
    assert cli.main(["bench", "--device", "tpu"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "{env,check,bench,demo}" in capsys.readouterr().out


def test_a_known_family_not_installed_says_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "families", lambda: ["layernorm"])
    assert cli.main(["check", "attention", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "attention is a family of openkernels but not installed here (installed: layernorm)" in err
    assert "pip install openkernels-attention" in err and "pip install ./packages/attention" in err
    assert cli.main(["check", "atention"]) == 2
    assert "unknown family atention (did you mean attention?)" in capsys.readouterr().err
    monkeypatch.setattr(cli, "families", lambda: [])
    assert cli.main(["bench", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no openkernels family is installed: pip install openkernels-activations openkernels-" in err


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (["bench", "--quik"], "openkernels bench", "unrecognized arguments: --quik (did you mean --quick?)"),
        (["check", "--devise", "cpu"], "openkernels check", "unrecognized arguments: --devise (did you mean --device?)"),
        (["env", "layernorm"], "openkernels env", "unrecognized arguments: layernorm"),
        (["bench", "--peer=torch", "--plott=x.png", "--quik"], "openkernels bench",
         "unrecognized arguments: --plott=x.png --quik (--plott=x.png: did you mean --plot?; "
         "--quik: did you mean --quick?)"),
    ],
    ids=["bench", "check", "env-positional", "two-typos"],
)  # fmt: skip
def test_an_unknown_option_is_reported_by_its_subcommand(argv, usage, error, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ") and f"{usage}: error: {error}" in err


def test_bench_quick_writes_json(tiny_layernorm: list, tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    argv = ["bench", "layernorm", "--device", "cpu", "--quick", "--peers", "torch", "--json", str(path)]
    assert cli.main(argv) == 0
    assert tiny_layernorm == [("torch",)]
    out = capsys.readouterr().out
    assert "== layernorm on cpu" in out and "rms_norm fwd 64x256 bfloat16" in out and "copy ceiling" in out
    assert re.search(r"^cpu .*: copy ceiling: [\d.]+ GB/s, the best of \d+ copies of 2 x \d+ MiB", out, re.M)
    assert "timing noise" in out
    data = json.loads(path.read_text())
    meta = data["meta"]
    cpu = meta["devices"]["cpu"]
    assert cpu["ceiling_gbps"] == max(cpu["ceiling_gbps_repeats"]) > 0 and meta["peers"] == ["torch"]
    assert meta["peers_skipped"] == {}
    assert meta["families"] == ["layernorm"] and meta["rep_ms"] == 50.0
    results = data["results"]
    assert {r["contender"] for r in results} == {"ours", "torch", "copy"}
    for r in results:
        assert set(r) == {f.name for f in fields(Measurement)}
        assert r["family"] == "layernorm" and r["op"] == "rms_norm" and r["shape"] == [64, 256]
        assert not r["error"] and r["ms"] > 0 and math.isfinite(r["ratio_to_ceiling"]) and r["spread"] >= 0


def test_bench_names_the_peers_it_skips(tiny_layernorm: list, monkeypatch, capsys) -> None:
    # layernorm has Liger's kernels only on GPUs: whether liger_kernel is installed decides the reason.
    monkeypatch.setitem(cli._PEER_PACKAGES, "liger", ("torch", "pip install liger-kernel"))  # installed
    argv = ["bench", "layernorm", "--device", "cpu", "--quick", "--peers", "torch,liger,ligr"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "peer liger skipped on cpu: no case of layernorm has it there" in captured.err
    assert "peer ligr skipped on cpu: no case of layernorm has it there" in captured.err
    assert "torch skipped" not in captured.err and " torch " in captured.out
    monkeypatch.setitem(cli._PEER_PACKAGES, "liger", ("no_such.liger_kernel", "pip install liger-kernel"))
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "peer liger skipped on cpu: no_such.liger_kernel is not installed (pip install liger-ker" in err


def test_bench_stops_when_no_requested_peer_can_run(tiny_layernorm: list, monkeypatch, capsys) -> None:
    monkeypatch.setitem(cli._PEER_PACKAGES, "liger", ("no_such_module", "pip install liger-kernel"))
    assert cli.main(["bench", "layernorm", "--device", "cpu", "--quick", "--peers", "liger"]) == 2
    captured = capsys.readouterr()
    assert "peer liger skipped on cpu: no_such_module is not installed (pip install liger-k" in captured.err
    assert "openkernels bench: none of the requested peers (liger) can run here" in captured.err
    assert "==" not in captured.out  # nothing was timed


def test_bench_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path, capsys) -> None:
    bench = importlib.import_module(f"openkernels.{_family('layernorm')}.bench")
    monkeypatch.setattr(bench, "cases", lambda *a, **k: pytest.fail("timed before checking matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    png = tmp_path / "bench.png"
    assert cli.main(["bench", "layernorm", "--device", "cpu", "--plot", str(png)]) == 2
    assert "openkernels bench: --plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err
    assert not png.exists()


def test_bench_plot_writes_png(tiny_layernorm: list, tmp_path) -> None:
    # matplotlib is a test dependency (noxfile TEST_DEPS): without it this fails, not skips.
    png = tmp_path / "bench.png"
    assert cli.main(["bench", "layernorm", "--device", "cpu", "--quick", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_every_device_and_contender(tmp_path, monkeypatch) -> None:
    """One panel per device, one bar per contender that ran, the ceiling's line at 1.0."""
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or savefig(fig, *a, **k))
    case = ("layernorm", "rms_norm", "fwd", (64, 256), "bfloat16")
    ran = (("ours", 0.5, ""), ("torch", 0.25, ""), ("copy", 0.75, ""), ("liger", 0, "RuntimeError"))
    results = [
        Measurement(*case, name, 1.0, 1.0, 0.0, ratio, device, error)
        for device in ("cpu x2", "NVIDIA H200")
        for name, ratio, error in ran
    ]
    cli._plot(results, str(tmp_path / "plot.png"))
    (figure,) = figures
    axes = figure.axes
    assert [ax.get_title() for ax in axes] == ["cpu x2", "NVIDIA H200"]
    for ax in axes:
        widths = sorted(round(bar.get_width(), 3) for bar in ax.patches)
        assert widths == [0.25, 0.5, 0.75]  # the failed liger row draws nothing
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ours", "torch", "copy (same bytes)"]
        assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines())
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_bench_reports_a_family_whose_cases_fail(monkeypatch, capsys) -> None:
    bench = importlib.import_module(f"openkernels.{_family('layernorm')}.bench")

    def cases(device, *, peers=()):
        raise ValueError("bad peer")

    monkeypatch.setattr(bench, "cases", cases)
    assert cli.main(["bench", "layernorm", "--device", "cpu", "--peers", "nope"]) == 1
    assert "layernorm on cpu: no cases: ValueError: bad peer" in capsys.readouterr().err


def test_demo_hands_its_arguments_to_model_demo(monkeypatch, capsys) -> None:
    got = []
    fake = types.ModuleType("openkernels.shared.dev.model_demo")
    fake.main = lambda argv: got.append(argv) or 7
    monkeypatch.setitem(sys.modules, "openkernels.shared.dev.model_demo", fake)
    assert cli.main(["demo", "--model", "tiny", "--help"]) == 7
    assert got == [["--model", "tiny", "--help"]]
    monkeypatch.setitem(sys.modules, "openkernels.shared.dev.model_demo", None)  # not shipped
    assert cli.main(["demo"]) == 2
    assert "openkernels.shared.dev.model_demo is missing" in capsys.readouterr().err


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_builds_cases_for_peers_torch(family: str) -> None:
    """`openkernels bench --peers torch` asks every family for the same peer: each builds
    its own directions with ours and torch side by side."""
    bench = cli._bench(family)  # the headline module its manifest names
    cases = bench.cases("cpu", peers=("torch",))
    assert cases, f"{family}: no benchmark cases on CPU"
    for case in cases:
        assert case.bytes > 0 and "ours" in case.contenders and "torch" in case.contenders
    assert callable(bench.checks)


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "openkernels.shared", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("openkernels-shared ")
