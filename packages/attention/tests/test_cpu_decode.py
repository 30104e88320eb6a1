"""The CPU decode kernel (cpu/decode.cpp): the CPU backend's path for unquantized caches
without rotary. Every scenario of test_kvcache.py it takes runs against the float64 reference
on both CPU paths (the kernel, and the gather path it replaced, pinned), which path ran is
checked, and so are what only the kernel does: splits of long caches (128K tokens), NaN kept in
its rows, lengths that point outside the cache refused, whole calls replayed."""

from __future__ import annotations

import platform

import pytest
import torch

import openkernels.attention as A
from openkernels.attention.core import cpu
from openkernels.attention.core.cpu import decode
from openkernels.attention.kvcache import cpu as cpu_kvcache
from openkernels.shared import cpu_build, dispatch, replay
from openkernels.shared.dev.testing import random_tensor

from .kvcache_cases import KVCall, Scenario, build, check_call
from .test_kvcache import LONG_SCENARIOS, SCENARIOS

pytestmark = pytest.mark.skipif(cpu_build.no_compiler_reason() is not None, reason="no C++ compiler")


def _takes(s: Scenario) -> bool:
    """Does the decode kernel take this scenario (decode.why_not, from the scenario)?"""
    return (s.bits == 16 and s.rotary is None and s.heads[0] // s.heads[1] * s.seqlen_q <= decode.MAX_ROWS
            and s.head_dim % 16 == 0)  # fmt: skip


_DECODE = [pytest.param(s, id=s.name) for s in SCENARIOS + LONG_SCENARIOS if _takes(s)]


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which CPU path ran each attention (the kernel, or the gather path's flash kernel). The
    gather path's dense attention is pinned to the flash kernel: the dense backend's own
    choice (the decode kernel takes short calls there too) is test_cpu_backend's."""
    monkeypatch.setattr(cpu, "FORCE_PATH", "sdpa")
    paths: list[str] = []
    real_decode, real_gather = decode.attend, cpu_kvcache.attn_fwd

    def via_decode(*args, **kwargs):
        paths.append("decode")
        return real_decode(*args, **kwargs)

    def via_gather(*args, **kwargs):
        paths.append("gather")
        return real_gather(*args, **kwargs)

    monkeypatch.setattr(decode, "attend", via_decode)
    monkeypatch.setattr(cpu_kvcache, "attn_fwd", via_gather)
    with replay.disabled():  # a replayed call would not come through the patched functions
        yield paths


def test_the_scenarios_cover_the_kernel() -> None:
    names = {p.id for p in _DECODE}
    assert len(names) >= 15 and any("70000" in n for n in names) and any("alibi" in n for n in names)


@pytest.mark.parametrize("scenario", _DECODE)
@pytest.mark.parametrize("path", ["decode", "gather"])
def test_both_cpu_paths_match_the_reference(
    scenario: Scenario, path: str, ran: list[str], monkeypatch
) -> None:
    monkeypatch.setattr(cpu_kvcache, "FORCE_PATH", path)
    check_call(build(scenario, "cpu"), "cpu", "cpu", path)
    assert ran and set(ran) == {path}


def test_the_default_path_is_the_kernel_where_it_runs(ran: list[str]) -> None:
    check_call(build(Scenario("decode", (3, 40), heads=(4, 2)), "cpu"), "cpu", "cpu")
    check_call(build(Scenario("quantized", (3, 40), fmt="int8"), "cpu"), "cpu", "cpu")
    check_call(build(Scenario("rotary", (3, 40), rotary="halves"), "cpu"), "cpu", "cpu")
    check_call(build(Scenario("wide-prefill", (3, 40), seqlen_q=33, heads=(4, 2)), "cpu"), "cpu", "cpu")
    assert ran == ["decode"] + ["gather"] * 6  # the gather path: one attention per sequence


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_128k_tokens_split_over_the_threads(dtype: str, ran: list[str]) -> None:
    # One sequence, one KV head: the keys are split (flash-decoding) and the splits merged.
    s = Scenario("decode-131072", (131071, 5000), heads=(4, 1), fmt=dtype, capacity=131072)
    check_call(build(s, "cpu"), "cpu", "cpu")
    assert ran == ["decode"]


def test_nan_stays_in_its_rows() -> None:
    call = build(Scenario("nan", (30, 12), append=False, heads=(4, 2), capacity=32), "cpu")
    call.q[0, 0, 1, 5] = float("nan")  # sequence 0, query head 1
    call.k_cache[1, 3, 0, 7] = float("nan")  # sequence 1, key 3 of KV head 0 (query heads 0, 1)
    out, lse = call.call()
    nan_rows = torch.isnan(out).any(-1)  # (B, Sq, Hq)
    expected = torch.zeros_like(nan_rows)
    expected[0, 0, 1] = expected[1, 0, 0] = expected[1, 0, 1] = True
    assert torch.equal(nan_rows, expected)
    assert torch.equal(torch.isnan(lse).transpose(1, 2), expected)


@pytest.mark.parametrize("strict", ["1", "0"])
def test_lengths_outside_the_cache_are_refused_before_anything_is_written(strict, monkeypatch) -> None:
    """Also without OPENKERNELS_STRICT: the refusal reaches the caller (dispatch's
    InvalidInputError), where it once fell back to the reference, which returned a result on
    the bad lengths, and kept every later call of the key off the CPU kernel."""
    monkeypatch.setenv("OPENKERNELS_STRICT", strict)
    q = random_tensor((2, 1, 4, 64), torch.bfloat16)
    k, v = (random_tensor((2, 16, 2, 64), torch.bfloat16) for _ in range(2))
    before = [k.clone(), v.clone()]
    for lens in ([3, 17], [-1, 2]):
        with pytest.raises(ValueError, match="outside the cache"):
            A.attention_with_kvcache(q, k, v, torch.tensor(lens, dtype=torch.int32), check=False)
    table = torch.tensor([[0], [5]], dtype=torch.int32)  # page 5 of 2
    with pytest.raises(ValueError, match="outside the cache"):
        A.attention_with_kvcache(
            q, k, v, torch.tensor([3, 4], dtype=torch.int32), block_table=table, check=False
        )
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])
    assert "failed earlier" not in dispatch.explain("attention_kvcache", q)


def test_unchecked_calls_replay_whole() -> None:
    call: KVCall = build(Scenario("replayed", (9, 30), append=False, heads=(4, 2), capacity=32), "cpu")
    results = [call.call(check=False) for _ in range(4)]
    kwargs = {**call.kwargs(), "check": False}  # in KVCall.call's order: keyword order is part of the key
    assert replay.entry_kind(A.attention_with_kvcache, call.q, call.k_cache, call.v_cache, call.cache_seqlens,
                             return_lse=True, **kwargs) == "launches"  # fmt: skip
    with replay.disabled():
        want = call.call(check=False)
    for out, lse in results:
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 flags")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx",)], ids=["avx2", "sse"])
def test_narrower_builds_match_the_reference(flags: tuple[str, ...], ran: list[str], monkeypatch) -> None:
    # The kernel's products run 16 lanes wide with AVX-512 (this machine and CI), 8 otherwise;
    # without AVX (what other CPUs compile: plain vector code) the eight sums are reduced one by one.
    monkeypatch.setattr(
        decode, "_lib", decode._load(f"openkernels_attention_decode_{'_'.join(flags)}", flags)
    )
    for s in (Scenario("decode-gqa", (3, 70), heads=(8, 2), head_dim=96, fmt="fp16"),
              Scenario("prefill3-alibi-softcap", (40, 9), seqlen_q=3, heads=(4, 1), alibi="heads", softcap=2.0,
                       fmt="fp32", page=16)):  # fmt: skip
        check_call(build(s, "cpu"), "cpu", "cpu", str(flags))
    assert set(ran) == {"decode"}
