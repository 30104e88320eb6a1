"""benchmarks/peers/e2e_decode_step.py on the CPU with its tiny model (a smoke test of the
script the 4-bit linear issue's end-to-end bar is measured with): every mode and switch runs,
reports times, kernel profiles and logit differences, and the A/B switches do what they say."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
for _family in ("activations", "layernorm", "attention", "quant"):
    pytest.importorskip(f"openkernels.{_family}")

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(PEERS))
    try:
        import e2e_decode_step

        yield e2e_decode_step
    finally:
        sys.path.remove(str(PEERS))


def test_eager_step_with_profile_and_switches(script, monkeypatch, tmp_path) -> None:
    import json

    from openkernels.layernorm.kernelize import decoder_fusion

    fused = []
    real = decoder_fusion.rms_norm
    monkeypatch.setattr(decoder_fusion, "rms_norm", lambda *a, **k: fused.append(1) or real(*a, **k))
    out = tmp_path / "step.json"
    argv = [
        "--tiny",
        "--device",
        "cpu",
        "--context",
        "24",
        "--reps",
        "1",
        "--mode",
        "eager",
        "--profile",
        "1",
    ]
    assert script.main([*argv, "--read-lengths", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert fused  # the decoder layers took the add + norm fusion
    for variant in ("sdpa", "ours-bf16", "ours-int4"):
        assert results[variant]["ms_per_step"] > 0 and results[variant]["timed"] == "eager"
        assert results[variant]["profile"]["launches_per_step"] > 0
    assert results["ours-bf16"]["max_logit_diff_vs_sdpa"] < 0.05  # bf16 against bf16
    fused.clear()
    assert script.main([*argv, "--skip", "model.layers.?,model.layers.??", "--json", str(out)]) == 0
    assert not fused and json.loads(out.read_text())["skip"] == ["model.layers.?", "model.layers.??"]


def test_int4_head_variant_quantizes_the_lm_head(script, monkeypatch, tmp_path) -> None:
    import json

    from openkernels.quant import linear

    reports = []
    real = linear.quantize_model
    monkeypatch.setattr(
        linear, "quantize_model", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1]
    )
    from openkernels.quant import kernelize as quant_kernelize

    monkeypatch.setattr(quant_kernelize, "quantize_model", linear.quantize_model)
    out = tmp_path / "step.json"
    argv = ["--tiny", "--device", "cpu", "--context", "24", "--reps", "1", "--mode", "eager", "--int4-head"]
    assert script.main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["ours-int4-head"]["ms_per_step"] > 0 and results["int4_head_x_ours_bf16"] > 0
    plain, head = reports  # ours-int4, then ours-int4-head
    assert "lm_head" not in plain.quantized and "lm_head" in head.quantized
    assert results["ours-int4-head"]["max_logit_diff_vs_sdpa"] < 1.0


def test_tc_routes_parse_and_wrap_default_tc(script, monkeypatch, tmp_path) -> None:
    """--tc-routes: explicit 'NxK=config' pairs, or the fastest tc row per shape at M = 1 of a
    quant_tc_gemv.py --json file; the wrapped default_tc answers for those shapes (M <= 8)
    and leaves every other call to quant's own choice."""
    import json

    from openkernels.quant import cuda as quant_cuda

    assert script.parse_tc_routes("2048x8192=tc-t1-u2-k4,3072x2048=tc-t1-u2") == {
        (2048, 8192): "tc-t1-u2-k4",
        (3072, 2048): "tc-t1-u2",
    }
    rows = [
        {"n": 2048, "k": 8192, "m": 1, "name": "F.linear bf16", "us": 1.0},  # not a tc config
        {"n": 2048, "k": 8192, "m": 1, "name": "tc-t1-u2", "us": 10.3},
        {"n": 2048, "k": 8192, "m": 1, "name": "tc-t1-u2-k4", "us": 5.1},
        {"n": 2048, "k": 8192, "m": 4, "name": "tc-t1-u2-k8", "us": 4.0},  # another M
        {"n": 2048, "k": 8192, "m": 1, "name": "tc-t1-u2-k8", "us": None},  # failed its check
    ]
    path = tmp_path / "study.json"
    path.write_text(json.dumps(rows))
    routes = script.parse_tc_routes(f"from:{path}")
    assert routes == {(2048, 8192): "tc-t1-u2-k4"}
    monkeypatch.setattr(quant_cuda, "default_tc", quant_cuda.default_tc)  # undone after the test
    script.route_tc(routes)
    assert quant_cuda.default_tc(1, 2048, 8192, 128, "sm_90") == "tc-t1-u2-k4"
    assert quant_cuda.default_tc(9, 2048, 8192, 128, "sm_90") is None
    assert quant_cuda.default_tc(1, 2048, 2048, 128, "sm_90") == "tc-t1-u2"


def test_tc_routes_pdl_wraps_default_tc(script, monkeypatch) -> None:
    """--tc-routes pdl: default_tc's configs, each as its "-p" variant; None stays None."""
    from openkernels.quant import cuda as quant_cuda

    monkeypatch.setattr(quant_cuda, "default_tc", quant_cuda.default_tc)  # undone after the test
    script.route_tc_pdl()
    assert quant_cuda.default_tc(1, 2048, 8192, 128, "sm_90") == "tc-t1-u2-k2-p"
    assert quant_cuda.tc_config(quant_cuda.default_tc(1, 16384, 2048, 128, "sm_90")).pdl
    assert quant_cuda.default_tc(9, 2048, 8192, 128, "sm_90") is None


def test_generate_report_runs_kernelized_models(tmp_path) -> None:
    """e2e_kv_decode.py --models (issue 24's generate() report: int4 weights against bf16
    weights, both kernelized): a row per model after sdpa's, sdpa on the plain model only, and
    the kernelized models' weights as asked (int4 layers only where int4 was asked)."""
    import json

    sys.path.insert(0, str(PEERS))
    try:
        import e2e_kv_decode
    finally:
        sys.path.remove(str(PEERS))
    from openkernels.quant import Int4Linear

    out = tmp_path / "generate.json"
    argv = ["--tiny", "--device", "cpu", "--batches", "1", "--prompt", "16", "--new", "3", "--formats", "bf16",
            "--models", "bf16,int4", "--reps", "1", "--json", str(out)]  # fmt: skip
    assert e2e_kv_decode.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["contender"] for r in rows] == ["sdpa", "ours-bf16 [bf16]", "ours-bf16 [int4]"]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    assert rows[1]["first_token_logit_err"] < 0.05  # bf16 weights against sdpa's bf16
    model = e2e_kv_decode.build(e2e_kv_decode.TINY, "cpu")
    assert not any(isinstance(m, Int4Linear) for m in e2e_kv_decode.kernelized(model, {}).modules())
    quantized = e2e_kv_decode.kernelized(model, e2e_kv_decode.MODELS["int4"])
    assert any(isinstance(m, Int4Linear) for m in quantized.modules())
    assert not any(isinstance(m, Int4Linear) for m in model.modules())  # the plain model stays as it was
    with pytest.raises(SystemExit):
        e2e_kv_decode.main(["--models", "fp4"])
