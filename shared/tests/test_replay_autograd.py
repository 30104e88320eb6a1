"""openkernels.shared.replay under autograd: a replayed call gives its results a C++ graph node
whose backward replays the recorded backward, and whose gradients, errors and graph behave
as the Python path's (a toy op y = x * w declared with opdef, on a toy CPU kernel)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from openkernels.shared import cpu_build, opdef, replay
from openkernels.shared.dev.testing.threads import run_in_threads

pytestmark = pytest.mark.skipif(not cpu_build.compiler_available(), reason="no C++ compiler")

_SOURCE = r"""
#include <cstdint>
extern "C" int toy_mul(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] * b[i];
  return 0;
}
extern "C" int toy_mul_packed(const int64_t* s) {
  return toy_mul(reinterpret_cast<const float*>(s[0]), reinterpret_cast<const float*>(s[1]),
                 reinterpret_cast<float*>(s[2]), s[3]);
}
"""

_LIB = torch.library.Library("openkernels_replay_grad_test", "DEF")
_STATE: dict = {}  # "kernels": the observed toy library; by their names: the defined ops
PYTHON_RUNS: list[str] = []  # which Python body ran: "public", "forward", "backward"


def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(a)
    _STATE["kernels"].toy_mul(a.data_ptr(), b.data_ptr(), y.data_ptr(), a.numel())
    return y


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    PYTHON_RUNS.append("forward")
    return _mul(x, w)


def _backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, want_x: bool, want_w: bool):
    PYTHON_RUNS.append("backward")
    grad = grad.contiguous()  # the toy kernel reads dense memory
    return (_mul(grad, w) if want_x else torch.empty(0), _mul(grad, x) if want_w else torch.empty(0))


def _grads(run, tensors, values, grads, needs):
    x, w = tensors
    gx, gw = run(grads[0], x, w, needs[0], needs[1])
    return (gx if needs[0] else None, gw if needs[1] else None)


def _toy_op(name: str, schema: str, forward, fake, backward: opdef.BackwardDef) -> opdef.DefinedOp:
    """openkernels::<name> of (x, w), both tensors, defined on its first use: a torch.library op
    lives as long as the process, and the module's fixtures may be set up again."""
    if name not in _STATE:
        op = opdef.OpDef(
            name=name, schema=schema, forward=forward, fake=fake, tensor_args=(0, 1), backward=backward
        )
        _STATE[name] = opdef.define(_LIB, op)
    return _STATE[name]


@pytest.fixture(scope="module")
def mul(toy_library):
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    _STATE["kernels"] = toy_library(_SOURCE, "openkernels_toy_replay_grad", {"toy_mul": [p, p, p, i64]})
    backward = opdef.BackwardDef(
        schema="(Tensor grad, Tensor x, Tensor w, bool want_x, bool want_w) -> (Tensor, Tensor)",
        compute=_backward,
        fake=lambda grad, x, w, want_x, want_w: (torch.empty_like(x), torch.empty_like(w)),
        save=lambda inputs, output: ((inputs[0], inputs[1]), ()),
        grads=_grads,
    )
    op = _toy_op(
        "toy_mul", "(Tensor x, Tensor w) -> Tensor", _forward, lambda x, w: torch.empty_like(x), backward
    )

    @replay.replayable
    def public(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        PYTHON_RUNS.append("public")
        return op(x, w)

    return public


@pytest.fixture(autouse=True)
def cpu_mode():
    before = replay.mode()
    replay.set_mode("cpu")
    PYTHON_RUNS.clear()
    yield
    replay.set_mode({"off": "0", "cpu": "cpu", "all": "all"}[before])


def _leaves(n: int = 6, w_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=w_grad)


def _warm(mul, n: int = 6, w_grad: bool = True) -> None:
    """Two calls (seen, recorded) and their backwards: the next call with this key replays."""
    for _ in range(2):
        x, w = _leaves(n, w_grad)
        mul(x, w).backward(torch.ones(n))
    PYTHON_RUNS.clear()


def test_a_replayed_call_under_autograd_runs_no_python_forward_or_backward(mul):
    _warm(mul)
    x, w = _leaves()
    y = mul(x, w)
    g = torch.randn(6)
    y.backward(g)
    assert PYTHON_RUNS == []
    torch.testing.assert_close(y, x.detach() * w.detach())
    torch.testing.assert_close(x.grad, g * w.detach())
    torch.testing.assert_close(w.grad, g * x.detach())
    assert y.grad_fn.name() == "Eager_toy_mulBackward" and y.requires_grad and not y.is_leaf
    assert replay.stats(mul)["hits"] == 1 and not replay.stats(mul)["refused"]


def test_gradients_flow_through_non_leaf_inputs_and_only_where_asked(mul):
    _warm(mul)
    a, w = _leaves()
    x = a * 2  # a non-leaf input: the gradient goes on through its own node
    y = mul(x, w)
    (gx,) = torch.autograd.grad(y, x, torch.ones(6), retain_graph=True)
    torch.testing.assert_close(gx, w.detach())
    y.sum().backward()  # a broadcast gradient: made dense as the Python path does
    torch.testing.assert_close(a.grad, 2 * w.detach())
    assert PYTHON_RUNS == []
    _warm(mul, w_grad=False)  # w without a gradient: another key, one edge
    x, w = _leaves(w_grad=False)
    mul(x, w).backward(torch.ones(6))
    torch.testing.assert_close(x.grad, w)
    assert PYTHON_RUNS == [] and w.grad is None


def test_gradients_unlike_the_recorded_one_take_the_python_backward(mul):
    _warm(mul, n=8)
    x = torch.randn(8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = mul(x, w)
    g = torch.randn(16)[::2]  # strided: not what the backward was recorded with
    y.backward(g)
    assert PYTHON_RUNS == ["backward"]
    torch.testing.assert_close(x.grad, g * w.detach())
    torch.testing.assert_close(w.grad, g * x.detach())


def test_create_graph_takes_the_library_backward_which_refuses_double_backward(mul):
    _warm(mul)
    x, w = _leaves()
    y = mul(x, w)
    (gx,) = torch.autograd.grad(y, x, torch.ones(6), create_graph=True)
    torch.testing.assert_close(gx, w.detach())
    with pytest.raises(Exception, match="double backward is not supported"):
        gx.sum().backward()


def test_saved_tensors_are_freed_and_checked_for_in_place_changes(mul):
    _warm(mul)
    x, w = _leaves()
    y = mul(x, w)
    y.backward(torch.ones(6), retain_graph=True)
    y.backward(torch.ones(6))  # retained: runs again, gradients accumulate
    torch.testing.assert_close(x.grad, 2 * w.detach())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(torch.ones(6))
    x, w = _leaves()
    y = mul(x, w)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.ones(6))


def test_hooks_see_the_replayed_gradients(mul):
    _warm(mul)
    x, w = _leaves()
    seen = []
    y = mul(x, w)
    y.register_hook(lambda g: seen.append(g.clone()) or g * 2)
    y.backward(torch.ones(6))
    assert len(seen) == 1
    torch.testing.assert_close(x.grad, 2 * w.detach())


def test_threads_backward_through_one_replayed_graph_at_once(mul):
    _warm(mul, n=64)
    x, w = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    y = mul(x, w)
    expected = w.detach().clone()

    def work() -> None:
        for _ in range(50):
            (gx,) = torch.autograd.grad(y, x, torch.ones(64), retain_graph=True)
            torch.testing.assert_close(gx, expected)

    assert run_in_threads(work, 4) == []


def test_grad_mode_off_or_not_wanted_replays_without_a_node(mul):
    _warm(mul)
    x, w = _leaves()
    with torch.no_grad():
        for _ in range(3):
            y = mul(x, w)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, x.detach() * w.detach())


def test_saved_tensor_hooks_pack_and_unpack_the_replayed_saves(mul):
    _warm(mul)
    packed = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(1)
        return t * 2  # what unpack gets back: the gradient shows it went through the hooks

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t / 2):
        x, w = _leaves()
        y = mul(x, w)
    y.backward(torch.ones(6))
    assert len(packed) == 2 and PYTHON_RUNS == []
    torch.testing.assert_close(x.grad, w.detach())


# A CPU op whose bodies compute with aten ops (no kernel library): both replay as programs,
# the forward's saved intermediate (tanh(x), a non-differentiable result) a value of its own.
def _tanh_mul_forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    PYTHON_RUNS.append("forward")
    t = torch.tanh(x)
    return t * w, t


def _tanh_mul_backward(
    grad: torch.Tensor, t: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    PYTHON_RUNS.append("backward")
    return grad * w * (1 - t * t), grad * t


@pytest.fixture(scope="module")
def tanh_mul():
    if not replay.available():
        pytest.skip("the replay extension cannot be built here")
    backward = opdef.BackwardDef(
        schema="(Tensor grad, Tensor t, Tensor w) -> (Tensor, Tensor)",
        compute=_tanh_mul_backward,
        fake=lambda grad, t, w: (torch.empty_like(t), torch.empty_like(w)),
        save=lambda inputs, output: ((output[1], inputs[1]), ()),
        grads=lambda run, tensors, values, grads, needs: run(grads[0], *tensors),
        non_differentiable=(1,),
    )
    fake = lambda x, w: (torch.empty_like(x), torch.empty_like(x))  # noqa: E731
    op = _toy_op(
        "toy_tanh_mul", "(Tensor x, Tensor w) -> (Tensor, Tensor)", _tanh_mul_forward, fake, backward
    )

    @replay.replayable
    def public(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return op(x, w)[0]

    return public


def test_a_cpu_op_computing_with_aten_replays_forward_and_backward_as_programs(tanh_mul):
    for n in (5, 5, 7, 7):  # two keys, each seen then recorded
        x, w = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
        tanh_mul(x, w).backward(torch.ones(n))
    assert replay.entry_kind(tanh_mul, x, w) == "program" and not replay.stats(tanh_mul)["refused"]
    PYTHON_RUNS.clear()
    for n in (5, 7):
        x, w = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
        y = tanh_mul(x, w)
        assert y.grad_fn.name() == "Eager_toy_tanh_mulBackward"
        g = torch.randn(n)
        y.backward(g, retain_graph=True)
        t = torch.tanh(x.detach())
        torch.testing.assert_close(y, t * w.detach())
        torch.testing.assert_close(x.grad, g * w.detach() * (1 - t * t))
        torch.testing.assert_close(w.grad, g * t)
        assert PYTHON_RUNS == []
        y.backward(torch.randn(2 * n)[::2])  # strided: the Python backward, same graph
        assert PYTHON_RUNS == ["backward"]
        PYTHON_RUNS.clear()
    with torch.no_grad():  # the saved intermediate is checked like any saved tensor
        x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
        y = tanh_mul(x, w)
    assert y.grad_fn is None
    x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    y = tanh_mul(x, w)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
