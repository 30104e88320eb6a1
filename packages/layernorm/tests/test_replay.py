"""Forward+backward calls of the norms replay (shared.replay's C++ graph node): outputs and
gradients equal the Python path's bit for bit, for every combination of options."""

from __future__ import annotations

import threading

import pytest
import torch

import openkernels.layernorm as L
from openkernels.shared import replay
from openkernels.shared.dev.testing.replayed import check_replayed_backward

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _tensors(device: str, dtype: torch.dtype, n: int = 96, rows: tuple[int, ...] = (3, 5)) -> dict:
    g = torch.Generator().manual_seed(1)

    def make(*shape, grad=True):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    return {
        "x": make(*rows, n),
        "w": make(n),
        "b": make(n),
        "r": make(*rows, n),
        "w_frozen": make(n, grad=False),
    }


CASES = {
    "rms": lambda t: (L.rms_norm, (t["x"], t["w"]), {}),
    "rms frozen weight": lambda t: (L.rms_norm, (t["x"], t["w_frozen"]), {}),
    "rms no weight": lambda t: (L.rms_norm, (t["x"],), {}),
    "rms residual": lambda t: (L.rms_norm, (t["x"], t["w"]), {"residual": t["r"]}),
    "rms prenorm": lambda t: (L.rms_norm, (t["x"], t["w"]), {"residual": t["r"], "prenorm": True}),
    "rms gemma offset": lambda t: (L.rms_norm, (t["x"], t["w"]), {"weight_offset": 1.0}),
    "layer": lambda t: (L.layer_norm, (t["x"], t["w"], t["b"]), {}),
    "layer residual prenorm": lambda t: (
        L.layer_norm,
        (t["x"], t["w"], t["b"]),
        {"residual": t["r"], "prenorm": True},
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_replays_as_the_python_path(case: str, dtype: torch.dtype, device: str) -> None:
    fn, args, kwargs = CASES[case](_tensors(device, dtype))
    check_replayed_backward(fn, args, kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_a_broadcast_gradient_replays_as_the_python_path(device: str) -> None:
    t = _tensors(device, torch.float32)

    # what `y.sum().backward()` hands the node: one element, expanded (zero strides)
    def broadcast(outs: tuple) -> list[torch.Tensor]:
        return [torch.ones((), dtype=outs[0].dtype, device=outs[0].device).expand_as(outs[0])]

    check_replayed_backward(L.rms_norm, (t["x"], t["w"]), grads=broadcast)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["rms", "layer residual prenorm"])
def test_long_rows_replay(case: str) -> None:
    """Rows long enough for the split kernels, forward (past 16384 columns) and backward (past
    8192): their arrival counters are kept per stream and left at 0 by the kernels, so the
    calls replay (a fill per call once kept them on the Python path), run after run."""
    fn, args, kwargs = CASES[case](_tensors("cuda", torch.bfloat16, n=40000, rows=(3,)))
    check_replayed_backward(fn, args, kwargs, expect_replay=True)


@pytest.mark.gpu
def test_a_replayed_backward_on_a_thread_without_a_cuda_context() -> None:
    """A thread that made no CUDA runtime call has no current context (autograd's device
    thread for GPU 0 is one): the replayed node binds the device's primary context before it
    launches. The backward runs on a fresh thread here (autograd's threads off)."""
    t = _tensors("cuda", torch.bfloat16)
    check_replayed_backward(L.rms_norm, (t["x"], t["w"]))  # recorded; the next call replays
    x, w = (a.detach().clone().requires_grad_() for a in (t["x"], t["w"]))
    y = L.rms_norm(x, w)
    g = torch.ones_like(y)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with torch.autograd.set_multithreading_enabled(False):
                y.backward(g)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    with replay.disabled():
        x2, w2 = (a.detach().clone().requires_grad_() for a in (t["x"], t["w"]))
        L.rms_norm(x2, w2).backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_a_missing_gradient_replays_with_zeros(device: str) -> None:
    # prenorm's residual output unused (`out.sum().backward()`): the node hands the recorded
    # backward zeros (small tensors) instead of running the op's Python backward; the
    # gradients equal the Python path's, which skips the term.
    t = _tensors(device, torch.float32)

    def only_the_output(outs: tuple) -> list:
        return [torch.ones_like(outs[0]), None]

    def python_backwards() -> int:
        return sum(
            s["hits"] + s["entries"] for name, s in replay.all_stats().items() if "_rms_backward" in name
        )

    kwargs = {"residual": t["r"], "prenorm": True}
    check_replayed_backward(L.rms_norm, (t["x"], t["w"]), kwargs, grads=only_the_output)
    before = python_backwards()
    check_replayed_backward(L.rms_norm, (t["x"], t["w"]), kwargs, grads=only_the_output)
    assert python_backwards() == before  # (with replay off the bodies are not counted)
