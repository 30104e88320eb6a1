"""Forward+backward calls of attention replay (shared.replay's C++ graph node): outputs and
gradients equal the Python path's bit for bit."""

from __future__ import annotations

import pytest
import torch

import openkernels.attention as K
from openkernels.shared.dev.testing.replayed import check_replayed_backward

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
CASES = {
    "full": {},
    "causal": {"causal": True},
    "window softcap": {"window": (8, 0), "softcap": 20.0},
    "lse": {"causal": True, "return_lse": True},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_replays_as_the_python_path(case: str, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(3)

    def make(s: int, h: int) -> torch.Tensor:
        return torch.randn(2, s, h, 64, generator=g).to(device=device, dtype=dtype).requires_grad_()

    kwargs = CASES[case]
    grads = None
    if kwargs.get("return_lse"):  # the log-sum-exp gets no gradient

        def grads(outs: tuple) -> list:
            return [torch.ones_like(outs[0]), None]

    check_replayed_backward(K.attention, (make(17, 4), make(23, 2), make(23, 2)), kwargs, grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", [False, True])
def test_kvcache_calls_replay_as_the_python_path(
    check: bool, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attention_with_kvcache appends in place and attends: replayed calls (CUDA, check=False)
    leave the same cache and output as the Python path; checked calls and CPU calls read the
    lengths on the host and are refused (they run the Python path, still equal). Not strict:
    a strict call saves the slots it appends to (a copy that refuses the recording)."""
    from openkernels.shared import dispatch, replay

    monkeypatch.delenv(dispatch.STRICT_ENV, raising=False)

    def run(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)

        def make(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

        k_cache, v_cache = make(2, 64, 2, 32), make(2, 64, 2, 32)
        lengths = torch.tensor([5, 40], dtype=torch.int32, device=device)
        out = K.attention_with_kvcache(make(2, 1, 8, 32), k_cache, v_cache, lengths, k_new=make(2, 1, 2, 32),
                                       v_new=make(2, 1, 2, 32), check=check)  # fmt: skip
        return out, k_cache, v_cache

    for seed in range(3):  # the second call of a key records, the third replays
        run(seed)
    before = replay.stats(K.attention_with_kvcache)["hits"]
    got = run(7)
    with replay.disabled():
        want = run(7)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    replayed = replay.stats(K.attention_with_kvcache)["hits"] > before
    assert replayed == (device == "cuda" and not check)


@pytest.mark.parametrize("device", [*DEVICES, "cpu-torch-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables", ["per batch", "shared"])
def test_rotary_replays_as_the_python_path(
    tables: str, dtype: torch.dtype, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apply_rotary (q and k in one call, two results): forward+backward bit for bit against the
    Python path; on the CPU the C++ kernel replays as a launch, the torch ops (no compiler,
    `cpu.rotary.FORCE_TORCH`) as a program. Each device has its own shapes: an entry recorded
    on one path keeps replaying it."""
    from openkernels.attention.rotary import cpu as cpu_rotary
    from openkernels.shared import cpu_build

    torch_ops = device == "cpu-torch-ops" or (device == "cpu" and cpu_build.no_compiler_reason() is not None)
    monkeypatch.setattr(cpu_rotary, "FORCE_TORCH", device == "cpu-torch-ops")
    heads = 3 if device == "cpu-torch-ops" else 4
    device = "cpu" if device == "cpu-torch-ops" else device
    g = torch.Generator().manual_seed(5)

    def make(*shape: int, grad: bool = True) -> torch.Tensor:
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_() if grad else t

    rows = (2, 9, 32) if tables == "per batch" else (9, 32)
    cos, sin = make(*rows, grad=False), make(*rows, grad=False)
    check_replayed_backward(K.apply_rotary, (make(2, 9, heads, 64), make(2, 9, 2, 64), cos, sin), {})

    from openkernels.shared import replay

    q, k = make(2, 9, heads, 64, grad=False), make(2, 9, 2, 64, grad=False)
    cos, sin = (
        cos[..., :16].contiguous(),
        sin[..., :16].contiguous(),
    )  # R = 16 of head_dim 64: a partial rotation
    for _ in range(3):
        K.apply_rotary(q, k, cos, sin)
    before = replay.stats(K.apply_rotary)["hits"]
    got = K.apply_rotary(q, k, cos, sin)
    with replay.disabled():
        want = K.apply_rotary(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if replay.available():  # forward calls replay: launches (GPU, C++ kernel) or a program
        assert replay.stats(K.apply_rotary)["hits"] == before + 1
        assert replay.entry_kind(K.apply_rotary, q, k, cos, sin) == ("program" if torch_ops else "launches")
