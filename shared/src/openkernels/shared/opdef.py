"""One declaration per op: from it `define` makes the torch.library op with its fake, the
backward op, the autograd formula, the dispatch registrations and the eager fast path.

A family declares each public op once::

    SILU_AND_MUL = opdef.define(_LIB, opdef.OpDef(
        name="silu_and_mul", schema="(Tensor x) -> Tensor",
        forward=forward_fn, fake=fake_fn, key=key_fn, impls=IMPLS,
        backward=opdef.BackwardDef(schema="(Tensor grad_out, Tensor x) -> Tensor", ...),
    ))

and calls `SILU_AND_MUL(x)` from its public function. The call takes the cheapest path that
is correct for its arguments:

- plain eager tensors (exact torch.Tensor or nn.Parameter, a model's weights, on the CPU
  or a CUDA/ROCm device, not under torch.compile) without autograd: the forward function itself, no library layers;
- the same with autograd: one `torch.autograd.Function` that runs the same forward and
  backward functions (the torch.library autograd layers cost more than a small kernel);
- anything else (tensor subclasses, FakeTensor and meta tensors, torch.compile): the
  library op, whose autograd registration calls the backward library op.

Both autograd paths save a `dispatch.snapshot()` in the forward and run the backward under
it, so `dispatch.force` / `strict` blocks around the forward steer the backward too, from
any number of threads at once.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import dispatch, replay

__all__ = [
    "Impl",
    "OpDef",
    "BackwardDef",
    "DefinedOp",
    "define",
    "plain_eager",
    "standard_impls",
    "library_call",
]

# True while a library op's body runs (torch.compile graphs, tensor subclasses). CUDA-graph
# trees warm such calls up and capture them into a private memory pool, which a buffer a
# launcher keeps for good (split-kernel counters, split-K scratch) must not come from:
# launchers ask `library_call()` and take temporaries then.
_LIBRARY_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "openkernels_library_call", default=False
)


def library_call() -> bool:
    """True while the body of an `openkernels::` library op (forward or backward) runs."""
    return _LIBRARY_CALL.get()


def _marked(body: Callable[..., Any]) -> Callable[..., Any]:
    """`body` run with library_call() true: what the library op registers."""

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = _LIBRARY_CALL.set(True)
        try:
            return body(*args, **kwargs)
        finally:
            _LIBRARY_CALL.reset(token)

    return run


@dataclass(frozen=True)
class Impl:
    """One dispatch registration: implementation `name` is the function at `target`
    ("package.module:function", imported on first use) with `bound` keyword arguments."""

    name: str
    target: str
    backends: tuple[str, ...]
    priority: int
    supports: Callable[[dispatch.DispatchKey], str | None] | None = None
    interpretable: bool = False
    bound: Mapping[str, Any] = field(default_factory=dict)


def standard_impls(package: str, entry: str, *, triton_supports: Callable[[dispatch.DispatchKey], str | None],
                   cpu_supports: Callable[[dispatch.DispatchKey], str | None], cpu: str | None = "cpu",
                   bound: Mapping[str, Any] | None = None) -> tuple[Impl, ...]:  # fmt: skip
    """Every family's three implementations of one op: `triton` (CUDA and ROCm, priority 20,
    runnable under the interpreter when forced), `cpu` (priority 10; `cpu` names the
    family's module, None when the op has no CPU kernel of its own) and `reference` (every
    device, priority 0), each at `<package>.<module>:<entry>` with `bound` keyword arguments."""
    bound = dict(bound or {})
    impls = [Impl("triton", f"{package}.triton:{entry}", ("cuda", "rocm"), 20, triton_supports, True, bound)]
    if cpu is not None:
        impls.append(Impl("cpu", f"{package}.{cpu}:{entry}", ("cpu",), 10, cpu_supports, False, bound))
    impls.append(
        Impl("reference", f"{package}.reference:{entry}", ("cuda", "rocm", "cpu"), 0, None, False, bound)
    )
    return tuple(impls)


@dataclass(frozen=True)
class BackwardDef:
    """The backward op `<name>_backward` and how the forward feeds it.

    schema: the backward op's schema; compute/fake: its eager body and its fake.
    save(inputs, output) -> (tensors, values): what the forward keeps for the backward
        (None among the tensors is kept as None).
    grads(backward, tensors, values, grad_outputs, needs_input_grad) -> one gradient (or
        None) per forward input; `backward` calls the backward op (the library op or
        `compute`, under the forward's steering); needs_input_grad: autograd's flags, one
        per forward input, so gradients nobody asked for are not computed.
    key, impls: its dispatch selection and registrations (none: `compute` dispatches
        under another op's name).
    non_differentiable: indices of forward outputs that get no gradient (marked so).
    materialize_grads: False hands `grads` None for the gradient of an output that was not
        used, instead of a tensor of zeros (ops with several outputs save the fill).
    """

    schema: str
    compute: Callable[..., Any]
    fake: Callable[..., Any]
    save: Callable[[tuple, Any], tuple[tuple[torch.Tensor, ...], tuple]]
    grads: Callable[[Callable[..., Any], tuple, tuple, tuple, tuple[bool, ...]], tuple]
    key: Callable[..., dispatch.DispatchKey] | None = None
    impls: Sequence[Impl] = ()
    non_differentiable: tuple[int, ...] = ()
    materialize_grads: bool = True


@dataclass(frozen=True)
class OpDef:
    """A public op `openkernels::<name>`.

    schema: "(args) -> returns" as torch.library takes it; forward/fake: its eager body and
    its fake (shapes and dtypes only). key, impls: dispatch selection and registrations
    under `name` (none: the op's body dispatches under another name). tensor_args: the
    positions of tensor arguments (the eager fast path needs each to be a plain tensor;
    the first decides the device); backward: None for an op without gradients.
    library_forward: the body the library op runs, when it must differ from the eager one;
    default `forward`. Either runs with `library_call()` true.
    """

    name: str
    schema: str
    forward: Callable[..., Any]
    fake: Callable[..., Any]
    key: Callable[..., dispatch.DispatchKey] | None = None
    impls: Sequence[Impl] = ()
    tensor_args: tuple[int, ...] = (0,)
    backward: BackwardDef | None = None
    tags: tuple[torch.Tag, ...] = ()
    library_forward: Callable[..., Any] | None = None


def _register(op: str, key: Callable | None, impls: Sequence[Impl]) -> None:
    if key is None:
        return
    dispatch.define(op, key)
    for impl in impls:
        dispatch.register(
            op,
            impl.name,
            dispatch.lazy(impl.target, **impl.bound),
            backends=impl.backends,
            priority=impl.priority,
            supports=impl.supports,
            interpretable=impl.interpretable,
        )


_EAGER_DEVICES = ("cpu", "cuda")  # torch reports ROCm devices as "cuda"
# Plain tensors: a Parameter is a Tensor to every torch layer below Python (it overrides no
# torch function); any other subclass takes the library op.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """The call may skip the torch.library layers: every tensor (None skipped) is plain (an
    exact torch.Tensor or nn.Parameter), the first on the CPU or a CUDA/ROCm device, and
    torch.compile is not tracing. Autograd is the caller's to check."""
    return (
        all(t is None or type(t) in _PLAIN for t in tensors)
        and tensors[0].device.type in _EAGER_DEVICES
        and not torch.compiler.is_compiling()
    )


class DefinedOp:
    """A defined op: call it like the forward (the fast path is picked per call)."""

    def __init__(self, op: OpDef, library: Any, eager: type[torch.autograd.Function] | None) -> None:
        self.op = op
        self.name = op.name
        self.library = library  # torch.ops.openkernels.<name>
        self.eager = eager
        # The eager bodies replay their kernels from C++ on a repeated key (shared.replay).
        self._forward = replay.replayable(op.forward)
        self._tensor_args = op.tensor_args
        self._first = op.tensor_args[0]

    @property
    def direct(self) -> Callable[..., Any]:
        """The eager forward without autograd (replayed on a repeated key), for callers that
        have already checked plain tensors and no gradients."""
        return self._forward

    def __call__(self, *args: Any) -> Any:
        first = args[self._first]
        if (
            type(first) in _PLAIN
            and first.device.type in _EAGER_DEVICES
            and not torch.compiler.is_compiling()
        ):
            plain = True
            grad = False
            for i in self._tensor_args:
                t = args[i]
                if t is None:
                    continue
                if type(t) not in _PLAIN:
                    plain = False
                    break
                grad = grad or t.requires_grad
            if plain:
                if grad and self.eager is not None and torch.is_grad_enabled():
                    return self.eager.apply(*args)
                if not grad or not torch.is_grad_enabled():
                    return self._forward(*args)
        return self.library(*args)


def _eager_function(op: OpDef, backward_op: Any) -> type[torch.autograd.Function]:
    bwd = op.backward
    assert bwd is not None
    # autograd.Function runs both bodies with grad mode off: their kernels replay (shared.replay).
    replayed_forward = replay.replayable(op.forward)
    replayed_compute = replay.replayable(bwd.compute)

    def forward(ctx, *args):
        out = replayed_forward(*args)
        replay.observe_function(ctx, out, bwd.materialize_grads)  # a recording under autograd
        ctx.set_materialize_grads(bwd.materialize_grads)
        tensors, values = bwd.save(args, out)
        ctx.save_for_backward(*tensors)
        ctx.values = values
        ctx.steering = dispatch.snapshot()  # the backward runs under the forward's force/strict
        if bwd.non_differentiable:
            ctx.mark_non_differentiable(*(out[i] for i in bwd.non_differentiable))
        return out

    def backward(ctx, *grad_outputs):
        steering = ctx.steering
        # create_graph=True: the library backward op, whose own autograd says that double
        # backward is not supported when the graph is differentiated again.
        compute = backward_op if torch.is_grad_enabled() else replayed_compute
        # A gradient that is a broadcast (`loss = y.sum()` gives an expanded one, zero strides)
        # is made dense here, outside the replayed body, whose own copy would be a torch op
        # that refuses the recording. Other strided gradients go in as they are (the kernels
        # take row strides; a body that copies one runs its Python path).
        grad_outputs = tuple(g if g is None or 0 not in g.stride() else g.contiguous() for g in grad_outputs)

        def run(*args):
            return steering.run(compute, *args)

        return tuple(bwd.grads(run, ctx.saved_tensors, ctx.values, grad_outputs, ctx.needs_input_grad))

    # Made with type(): autograd names the graph nodes after the class (Eager_<op>Backward).
    name = f"Eager_{op.name}"
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward), "__qualname__": name})  # fmt: skip


def define(lib: torch.library.Library, op: OpDef) -> DefinedOp:
    """Define `openkernels::<op.name>` (and `<op.name>_backward`) in `lib`, register the
    fakes, the autograd formula and the dispatch implementations; return the callable."""
    qualified = f"{lib.ns}::{op.name}"
    lib.define(op.name + op.schema, tags=op.tags)
    lib.impl(op.name, _marked(op.library_forward or op.forward), "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, op.fake, lib=lib)
    _register(op.name, op.key, op.impls)
    namespace = getattr(torch.ops, lib.ns)
    eager = None
    bwd = op.backward
    if bwd is not None:
        bwd_name = f"{op.name}_backward"
        lib.define(bwd_name + bwd.schema)
        lib.impl(bwd_name, _marked(bwd.compute), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{qualified}_backward", bwd.fake, lib=lib)
        _register(bwd_name, bwd.key, bwd.impls)
        backward_op = getattr(namespace, bwd_name).default

        def setup_context(ctx, inputs, output) -> None:
            ctx.set_materialize_grads(bwd.materialize_grads)
            tensors, values = bwd.save(tuple(inputs), output)
            ctx.save_for_backward(*tensors)
            ctx.values = values
            ctx.steering = dispatch.snapshot()  # the backward runs under the forward's force/strict
            if bwd.non_differentiable:
                ctx.mark_non_differentiable(*(output[i] for i in bwd.non_differentiable))

        def autograd_backward(ctx, *grad_outputs):
            steering = ctx.steering

            def run(*args):
                return steering.run(backward_op, *args)

            return tuple(bwd.grads(run, ctx.saved_tensors, ctx.values, grad_outputs, ctx.needs_input_grad))

        torch.library.register_autograd(qualified, autograd_backward, setup_context=setup_context, lib=lib)

        def no_double_backward(ctx, *grads):
            raise NotImplementedError(f"{qualified}_backward: double backward is not supported")

        torch.library.register_autograd(f"{qualified}_backward", no_double_backward, lib=lib)
        eager = _eager_function(op, backward_op)
    return DefinedOp(op, getattr(namespace, op.name), eager)
