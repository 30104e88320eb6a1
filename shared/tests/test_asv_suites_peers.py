"""The asv peer suites and the end-to-end suite (benchmarks/asv_suite) on the CPU in smoke mode,
the way asv runs them (setup_cache, then setup and the track_* lookups per combination): a peer
that is not installed or cannot run here is n/a (NotImplementedError), never a failure; each
family's torch peer is measured; the end-to-end suite's tiny model gives times."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITES = ROOT / "benchmarks" / "asv_suite"


def _suites() -> ModuleType:
    """The asv_suite package, imported as asv imports it (by name, from its folder)."""
    if "asv_suite" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "asv_suite", SUITES / "__init__.py", submodule_search_locations=[str(SUITES)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["asv_suite"] = module
        spec.loader.exec_module(module)
    return sys.modules["asv_suite"]


def _suite(module: str, cls: str) -> object:
    _suites()
    return getattr(importlib.import_module(f"asv_suite.{module}"), cls)()


# family module, peer suite class, the peer that runs on every CPU (torch), one combination's
# leading parameters (before dtype and peer)
TORCH_PEERS = [
    ("attention", "AttentionPeers", "SDPA", ("causal", "fwd", "2x8x1024x64")),
    ("attention", "DecodePeers", "SDPA (enable_gqa)", ("4x32x8x1024x128",)),
    ("layernorm", "LayerNormPeers", "torch eager", ("rms_norm", "fwd+bwd", "4096x4096")),
    ("activations", "ActivationsPeers", "torch eager", ("silu_and_mul", "bwd", "4096x4096")),
    ("quant", "Int4LinearPeers", "F.linear (16-bit weight)", ("int4", "16", "4096x4096")),
]
# peers that need a GPU, a library this CPU test environment lacks, or both
GPU_PEERS = [
    ("attention", "AttentionPeers", "FlashAttention-2 (SDPA flash)"),
    ("attention", "AttentionPeers", "xFormers (SDPA efficient)"),
    ("attention", "AttentionPeers", "cuDNN (SDPA cudnn)"),
    ("attention", "AttentionPeers", "FlashAttention-4"),
    ("layernorm", "LayerNormPeers", "Liger"),
    ("layernorm", "LayerNormPeers", "QuACK"),
    ("activations", "ActivationsPeers", "Liger"),
    ("quant", "Int4LinearPeers", "tinygemm (torch int4)"),
]


@pytest.fixture()
def smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENKERNELS_ASV_SMOKE", "1")
    monkeypatch.delenv("OPENKERNELS_ASV_SELECT", raising=False)


def _select(monkeypatch: pytest.MonkeyPatch, suite: object, combos: list[tuple[str, ...]]) -> None:
    """OPENKERNELS_ASV_SELECT naming these combinations, as benchmarks/asv_history.py writes it."""
    module = type(suite).__module__.split(".", 1)[-1]
    names = [
        re.escape(f"{module}.{type(suite).__name__}.")
        + r"track_\w+"
        + re.escape(f"({', '.join(map(repr, c))})")
        for c in combos
    ]
    monkeypatch.setenv("OPENKERNELS_ASV_SELECT", "^(?:" + "|".join(names) + ")$")


def _finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_peer_grids_time_bfloat16_and_each_peer_on_its_devices() -> None:
    for module, cls, peer, _ in TORCH_PEERS:
        suite = _suite(module, cls)
        assert suite.param_names[-2:] == ["dtype", "peer"]
        assert suite.combos("cpu"), cls
        assert all(c[-2] == "bfloat16" for c in suite.combos("cpu") + suite.combos("cuda"))
        assert peer in {c[-1] for c in suite.combos("cpu")}
    for module, cls, peer in GPU_PEERS:
        suite = _suite(module, cls)
        assert peer not in {c[-1] for c in suite.combos("cpu")}, (cls, peer)
        assert peer in {c[-1] for c in suite.combos("cuda")}, (cls, peer)


def test_torch_peers_are_measured_and_missing_peers_are_na(smoke, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a) and (b) through asv's protocol. The GPU peers are let onto the CPU here so that their
    CPU-side path runs: no library, no contender in the case, or a first call that fails on a
    CPU tensor must each end as n/a, never as an error that fails the suite."""
    for module, cls, peer, lead in TORCH_PEERS:
        suite = _suite(module, cls)
        others = [p for m, c, p in GPU_PEERS if (m, c) == (module, cls)]
        monkeypatch.setattr(suite, "peer_devices", {})  # every peer applies on the CPU
        combos = [(*lead, "bfloat16", p) for p in (peer, *others)]
        assert set(combos) <= set(suite.combos("cpu"))
        _select(monkeypatch, suite, combos)
        cache = suite.setup_cache()
        assert combos[0] in cache and set(cache) <= set(combos), cache
        assert not [c for c, found in cache.items() if "error" in found], cache  # no peer failed
        suite.setup(cache, *combos[0])
        tracks = [n for n in dir(suite) if n.startswith("track_")]
        for track in tracks:
            assert _finite_positive(getattr(suite, track)(cache, *combos[0])), (cls, track)
        for combo in combos[1:]:
            if combo not in cache:  # (SDPA's flash backend has a CPU kernel too)
                with pytest.raises(NotImplementedError):
                    suite.setup(cache, *combo)


@pytest.mark.parametrize(("module", "cls", "peer"), GPU_PEERS)
def test_gpu_peers_on_a_cpu_are_na(smoke, module: str, cls: str, peer: str) -> None:
    import torch

    suite = _suite(module, cls)
    lead = next(lead for m, c, _, lead in TORCH_PEERS if (m, c) == (module, cls))
    params = dict(zip(suite.param_names, (*lead, "bfloat16", peer), strict=True))
    with pytest.raises(NotImplementedError, match="runs on cuda only"):
        suite.measure(torch.device("cpu"), params)


@pytest.mark.parametrize(
    ("module", "cls", "peer", "library"),
    [
        ("attention", "AttentionPeers", "FlashAttention-4", "flash_attn"),
        ("layernorm", "LayerNormPeers", "QuACK", "quack"),
    ],
)
def test_a_peer_library_that_is_not_installed_is_na(
    smoke, module: str, cls: str, peer: str, library: str
) -> None:
    if importlib.util.find_spec(library) is not None:
        pytest.skip(f"{library} is installed here")
    import torch

    suite = _suite(module, cls)
    lead = next(lead for m, c, _, lead in TORCH_PEERS if (m, c) == (module, cls))
    with pytest.raises(NotImplementedError, match="does not import"):
        suite.build(
            torch.device("cpu"), **dict(zip(suite.param_names, (*lead, "bfloat16", peer), strict=True))
        )


def test_e2e_tiny_model_gives_times(smoke) -> None:
    """(c) every end-to-end combination of a CPU: prefill, training step and eager decode, the
    unmodified model and the kernelized ones; compiled decode is n/a (CUDA only)."""
    suite = _suite("e2e", "E2E")
    combos = suite.combos("cpu")
    assert {c[0] for c in combos} == {"prefill", "train", "decode"}
    assert {c[2] for c in combos} == {"transformers", "openkernels", "openkernels-int4"}
    assert ("decode", "compiled", "openkernels") in suite.combos("cuda")
    cache = suite.setup_cache()
    assert set(cache) == set(combos), cache
    for combo in combos:
        suite.setup(cache, *combo)
        assert _finite_positive(suite.track_ms(cache, *combo)), combo
        assert _finite_positive(suite.track_tokens_per_s(cache, *combo)), combo
    with pytest.raises(NotImplementedError):
        suite.setup(cache, "decode", "compiled", "transformers")
