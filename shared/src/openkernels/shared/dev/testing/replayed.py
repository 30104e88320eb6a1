"""Check that a public function's replayed calls under autograd (shared.replay's C++ graph
node) give the Python path's results and gradients, bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ... import replay

__all__ = ["check_replayed_backward"]


def _leaf(t: object) -> object:
    return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def _run(fn: Callable, inputs: Sequence[object], kwargs: dict, grads: Callable) -> tuple:
    """One forward and backward on fresh leaves with the values of the tensor arguments
    (positional and keyword): (outputs, gradients)."""
    args = [_leaf(t) for t in inputs]
    named = {k: _leaf(v) for k, v in kwargs.items()}
    out = fn(*args, **named)
    outs = out if isinstance(out, tuple) else (out,)
    pairs = [(o, g) for o, g in zip(outs, grads(outs), strict=True) if o.requires_grad and g is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    leaves = [t for t in (*args, *named.values()) if isinstance(t, torch.Tensor)]
    return tuple(o.detach() for o in outs), tuple(t.grad for t in leaves)


def check_replayed_backward(
    fn: Callable,
    inputs: Sequence[object],
    kwargs: dict | None = None,
    grads: Callable[[tuple], Sequence[torch.Tensor]] | None = None,
    *,
    expect_replay: bool | None = None,
) -> None:
    """Call fn(*inputs, **kwargs) under autograd (tensors among them: fresh leaves each time,
    with their values and requires_grad) four times (seen, recorded, replayed twice)
    and once with replay off; outputs and input gradients must be equal bit for bit. `grads`
    makes the output gradients from the outputs (None for one that gets none; default: a
    fixed random one each, dense).
    expect_replay: the last calls must have replayed; None (default): wherever the same call
    without autograd replays (as launches, or as a program: a CPU body that computes in torch)."""
    kwargs = kwargs or {}
    if grads is None:
        generator = torch.Generator().manual_seed(0)
        fixed: dict = {}

        def grads(outs: tuple) -> list[torch.Tensor]:
            for i, o in enumerate(outs):
                if i not in fixed:
                    fixed[i] = torch.randn(o.shape, generator=generator).to(o.dtype).to(o.device)
            return [fixed[i] for i in range(len(outs))]

    if expect_replay is None:
        with torch.no_grad():
            for _ in range(3):
                fn(*inputs, **kwargs)
            expect_replay = replay.entry_kind(fn, *inputs, **kwargs) in ("launches", "program")
    before = replay.stats(fn)["hits"]
    runs = [_run(fn, inputs, kwargs, grads) for _ in range(4)]
    with replay.disabled():
        want = _run(fn, inputs, kwargs, grads)
    stats = replay.stats(fn)
    if expect_replay and replay.available():
        assert stats["hits"] >= before + 2, f"not replayed: {stats}"
    for outs, input_grads in runs:
        for got, ref in zip(outs, want[0], strict=True):
            assert torch.equal(got, ref), "a replayed output differs from the Python path's"
        for got, ref in zip(input_grads, want[1], strict=True):
            assert (got is None) == (ref is None), "a gradient is missing on one path"
            if got is not None:
                assert torch.equal(got, ref), "a replayed gradient differs from the Python path's"
