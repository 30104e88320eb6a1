"""shared.opdef (a toy op: factor * x^2): one declaration gives the library op (fake, autograd, backward op), the
dispatch registrations and the eager paths; each call takes the path its arguments allow."""

from __future__ import annotations

import pytest
import torch

from openkernels.shared import dispatch, opdef
from openkernels.shared.dev.testing.ops import run_opcheck
from openkernels.shared.dev.testing.threads import run_in_threads

_LIB = torch.library.Library("openkernels_opdef_test", "DEF")
CALLS: list[str] = []  # which implementation ran, forward and backward
LIBRARY_CALL: list[bool] = []  # opdef.library_call() in each body that ran


def _scale_fwd(x: torch.Tensor, out: torch.Tensor, factor: float, *, tag: str) -> None:
    CALLS.append(f"{tag} fwd")
    LIBRARY_CALL.append(opdef.library_call())
    out.copy_(x * x * factor)


def _scale_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, grad_in: torch.Tensor, factor: float, *, tag: str
) -> None:
    CALLS.append(f"{tag} bwd")
    LIBRARY_CALL.append(opdef.library_call())
    grad_in.copy_(grad_out * 2 * x * factor)


def _impls(direction: str) -> tuple[opdef.Impl, ...]:
    target = f"{__name__}:_scale_{direction}"
    return (
        opdef.Impl("fast", target, ("cpu",), 10, bound={"tag": "fast"}),
        opdef.Impl("reference", target, ("cpu", "cuda", "rocm"), 0, bound={"tag": "reference"}),
    )


def _forward(x: torch.Tensor, factor: float) -> torch.Tensor:
    out = torch.empty_like(x)
    dispatch.run("opdef_test_scale", x, out, factor)
    return out


def _backward(grad_out: torch.Tensor, x: torch.Tensor, factor: float) -> torch.Tensor:
    grad_in = torch.empty_like(grad_out)
    dispatch.run("opdef_test_scale_backward", grad_out, x, grad_in, factor)
    return grad_in


def _key(x: torch.Tensor, *args: object) -> dispatch.DispatchKey:
    return dispatch.key_for(x)


def _define() -> opdef.DefinedOp:
    return opdef.define(
        _LIB,
        opdef.OpDef(
            name="opdef_test_scale",
            schema="(Tensor x, float factor) -> Tensor",
            forward=_forward,
            fake=lambda x, factor: torch.empty_like(x),
            key=_key,
            impls=_impls("fwd"),
            backward=opdef.BackwardDef(
                schema="(Tensor grad_out, Tensor x, float factor) -> Tensor",
                compute=_backward,
                fake=lambda grad_out, x, factor: torch.empty_like(grad_out),
                save=lambda inputs, output: ((inputs[0],), (inputs[1],)),
                grads=lambda run, tensors, values, grads, needs: (run(grads[0], tensors[0], values[0]), None),
                key=_key,
                impls=_impls("bwd"),
            ),
        ),
    )


_DEFINED: list[opdef.DefinedOp] = []


@pytest.fixture(scope="module")
def scale():
    """The toy op, defined when this module's tests run (not at collection) and taken out of
    dispatch afterwards: tests that walk every registered op (the CLI's env) must not meet
    it. The torch.library op lives as long as the process: defined once."""
    if not _DEFINED:
        _DEFINED.append(_define())
    else:
        opdef._register("opdef_test_scale", _key, _impls("fwd"))
        opdef._register("opdef_test_scale_backward", _key, _impls("bwd"))
    yield _DEFINED[0]
    for op in ("opdef_test_scale", "opdef_test_scale_backward"):
        dispatch._OPS.pop(op, None)
    dispatch.changed()


@pytest.fixture(autouse=True)
def _fresh_calls():
    CALLS.clear()
    LIBRARY_CALL.clear()


def test_library_call_is_true_in_library_bodies_only(scale) -> None:
    """Launchers keep buffers for good only outside library bodies (torch.compile's CUDA-graph
    trees run those in a private pool): eager paths say False, the library op's forward and
    backward say True, and the flag is back to False after. (A shape of its own: calls of a
    key seen before may replay, running no body.)"""
    x = torch.arange(7.0, requires_grad=True)
    with torch.no_grad():
        scale(x, 3.0)
    scale(x, 3.0).sum().backward()
    assert LIBRARY_CALL == [False, False, False]
    LIBRARY_CALL.clear()
    scale.library(x, 3.0).sum().backward()
    assert CALLS[-2:] == ["fast fwd", "fast bwd"] and LIBRARY_CALL == [True, True]
    assert not opdef.library_call()


def test_no_grad_eager_call_runs_the_forward_directly(scale, monkeypatch: pytest.MonkeyPatch) -> None:
    def library_must_not_run(*args):
        raise AssertionError("the library op ran")

    monkeypatch.setattr(scale, "library", library_must_not_run)
    x = torch.arange(4.0)
    torch.testing.assert_close(scale(x, 3.0), x * x * 3)
    assert CALLS == ["fast fwd"]


def test_grad_eager_call_uses_one_autograd_function(scale) -> None:
    x = torch.arange(4.0, requires_grad=True)
    y = scale(x, 3.0)
    assert type(y.grad_fn).__name__.startswith("Eager_opdef_test_scale")
    y.sum().backward()
    torch.testing.assert_close(x.grad, 6 * x.detach())
    assert CALLS == ["fast fwd", "fast bwd"]


def test_parameters_take_the_eager_paths(scale, monkeypatch: pytest.MonkeyPatch) -> None:
    # A model's weights are nn.Parameter: a Tensor to every torch layer, so no library op.
    def library_must_not_run(*args):
        raise AssertionError("the library op ran")

    monkeypatch.setattr(scale, "library", library_must_not_run)
    w = torch.nn.Parameter(torch.arange(4.0))
    with torch.no_grad():
        torch.testing.assert_close(scale(w, 3.0), w * w * 3)
    y = scale(w, 3.0)
    assert type(y.grad_fn).__name__.startswith("Eager_opdef_test_scale")
    y.sum().backward()
    torch.testing.assert_close(w.grad, 6 * w.detach())
    assert CALLS == ["fast fwd", "fast fwd", "fast bwd"]


def test_meta_and_subclass_calls_take_the_library_op(scale) -> None:
    out = scale(torch.empty(5, device="meta"), 2.0)
    assert out.device.type == "meta" and out.shape == (5,)
    assert CALLS == []


def test_force_in_the_forward_steers_the_backward_on_both_autograd_paths(scale) -> None:
    for call in (scale, torch.ops.openkernels_opdef_test.opdef_test_scale):
        CALLS.clear()
        x = torch.arange(3.0, requires_grad=True)
        with dispatch.force("reference"):
            y = call(x, 2.0)
        y.sum().backward()  # outside the block: the saved steering applies
        assert CALLS == ["reference fwd", "reference bwd"], call


def test_backward_from_many_threads_at_once(scale) -> None:
    x = torch.arange(8.0, requires_grad=True)
    loss = scale(x, 5.0).sum()

    def worker() -> None:
        for _ in range(20):
            (g,) = torch.autograd.grad(loss, x, retain_graph=True)
            assert torch.equal(g, 10 * x.detach())

    errors = run_in_threads(worker, 6)
    assert not errors, errors


def test_double_backward_says_unsupported(scale) -> None:
    x = torch.arange(3.0, requires_grad=True)
    (g,) = torch.autograd.grad(scale(x, 2.0).sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward is not supported"):
        g.sum().backward()


def test_library_op_passes_opcheck_and_compiles(scale) -> None:
    x = torch.randn(6, requires_grad=True)
    run_opcheck(torch.ops.openkernels_opdef_test.opdef_test_scale.default, (x, 1.5))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: scale(t, 1.5) * 2, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, x.detach() ** 2 * 3)
    torch.testing.assert_close(x.grad, 6 * x.detach())


def test_a_registry_change_reaches_calls_already_replayed(scale) -> None:
    """A recorded call replays the implementation chosen then; registering another one
    (dispatch.changed) makes every replayable forget its recordings."""
    from openkernels.shared import replay

    x = torch.arange(4.0)
    for _ in range(4):
        torch.testing.assert_close(scale(x, 3.0), x * x * 3)
    runs = len(CALLS)

    def faster(x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
        CALLS.append("faster fwd")
        out.copy_(x * x * factor)

    dispatch.register("opdef_test_scale", "faster", faster, backends=("cpu",), priority=30)
    try:
        torch.testing.assert_close(scale(x, 3.0), x * x * 3)
        assert CALLS[runs:] == ["faster fwd"]
    finally:
        impls = dispatch._op("opdef_test_scale").impls
        impls[:] = [i for i in impls if i.name != "faster"]
        dispatch.changed()
    if replay.available():
        assert replay.stats(scale.direct)["hits"] >= 1
