"""Eager replay of recorded calls: from its third call with the same argument metadata, a
public op runs no Python beyond a wrapper.

`@replayable` wraps a public function. Its second call with a given key (every tensor's
dtype, device, sizes, strides and 16-byte alignment; None, bools, ints, floats, dtypes and
tuples of them by value; keyword names; which tensors share an address; the CPU thread
count and the current CUDA device)
runs the function as usual while a recording watches it: the tensors it allocates, the
aten ops it runs and the kernels it launches (CPU kernels through `observe_library`,
Triton kernels through `openkernels.shared.launch`). When the call did nothing but
allocate, take views and launch kernels whose pointer arguments are its inputs or its
allocations, the C extension (`cpu/replay.cpp`, compiled on first use) keeps the
allocations and launches; later calls with the same key allocate and launch straight from
C++. (The first call of a key only marks it seen: one-off shapes, such as a prefill of each
length, never pay for a recording.) Anything else (an aten op that computes, a kernel launched another way, a pointer
into the middle of a tensor, a Triton kernel that needs scratch memory) marks the key as
not replayable, and its calls keep taking the Python path.

The contract of a replayable function: its launches depend on its arguments only through
that key (it reads no tensor values on the host). Calls with tensor subclasses, under
torch.compile, under `dispatch.force` / `forbid`, or with arguments of other types are never
replayed.

Under autograd (an input that requires grad, grad mode on: part of the key), a call whose
graph is one opdef `autograd.Function` over its own arguments replays with its graph: the
recording also runs the op's backward once on the saved tensors and a dense gradient of
zeros (`_grad_plan`), and the C side gives replayed results a C++ autograd node that holds
the saved tensors and launches the recorded backward; a gradient unlike the recorded one, or
create_graph=True, runs the op's Python backward from that node (docs/replay.md).

OPENKERNELS_REPLAY: "1" / "all" (default) replays calls on CPU and CUDA tensors (Triton
kernels launched with cuLaunchKernelEx, as Triton's own launcher does; checked bitwise
against the Python path on the H200 by benchmarks/gpu/check_replay_gpu.py); "cpu" only on CPU
tensors; "0" turns replay off. A replayed Triton launch does not call Triton's launch hooks
(profilers): turn replay off to profile.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.machinery
import importlib.util
import os
import pathlib
import struct
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import cpu_build, dispatch, launch

__all__ = [
    "MODE_ENV",
    "replayable",
    "observe_library",
    "persistent",
    "set_mode",
    "mode",
    "disabled",
    "stats",
    "entry_kind",
    "available",
]

MODE_ENV = "OPENKERNELS_REPLAY"
_SOURCE = pathlib.Path(__file__).with_name("cpu") / "replay.cpp"
_MODES = {"0": "off", "": "off", "off": "off", "cpu": "cpu", "1": "all", "all": "all"}

F = TypeVar("F", bound=Callable[..., Any])


class _State:
    mode = _MODES.get(os.environ.get(MODE_ENV, "all").strip().lower(), "all")
    module: Any = None  # the C extension, once built
    failed: str | None = None  # why it could not be built (no retry)
    lock = threading.Lock()
    local = threading.local()  # .recording: the recording of this thread, if any
    replayables: ClassVar[list[_Replayable]] = []


def mode() -> str:
    """ "off", "cpu" or "all"."""
    return _State.mode


def set_mode(value: str) -> None:
    """Change the mode ("0"/"off", "cpu", "1"/"all") and forget every recorded call."""
    if value not in _MODES:
        raise ValueError(f"replay mode must be one of {sorted(_MODES)}, got {value!r}")
    _State.mode = _MODES[value]
    if _State.module is not None:
        _State.module.set_cuda(_State.mode == "all")
    for r in _State.replayables:
        if r.table is not None:
            r.table.clear()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """No replay (nor recording) inside the block, for every thread (profiling, tests)."""
    before = _State.mode
    _State.mode = "off"
    try:
        yield
    finally:
        _State.mode = before


def _build_flags() -> list[str]:
    from torch.utils import cpp_extension

    lib = pathlib.Path(torch.__file__).parent / "lib"
    flags = [f"-I{p}" for p in cpp_extension.include_paths()]
    flags += [f"-I{sysconfig.get_paths()['include']}", f"-L{lib}", f"-Wl,-rpath,{lib}", "-Wl,--no-as-needed"]
    flags += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    # In the flags, so in the cache key: another torch or Python builds its own library.
    flags += [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
              f"-DOK_TORCH_VERSION={torch.__version__}", f"-DOK_PYTHON={sysconfig.get_python_version()}"]  # fmt: skip
    return flags


def _module() -> Any:
    """The C extension (built on first use), or None where it cannot be built (one warning)."""
    if _State.module is not None or _State.failed is not None:
        return _State.module
    with _State.lock:
        if _State.module is None and _State.failed is None:
            try:
                lib = cpu_build.load_library(_SOURCE, name="openkernels_replay", extra_flags=_build_flags())
                path = lib._name
                loader = importlib.machinery.ExtensionFileLoader("openkernels_replay", path)
                spec = importlib.util.spec_from_file_location("openkernels_replay", path, loader=loader)
                assert spec is not None
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
                module.set_cuda(_State.mode == "all")
                global _MISS, _SKIP
                _MISS, _SKIP = module.MISS, module.SKIP
                _State.module = module
            except Exception as error:  # any failure turns replay off, once
                _State.failed = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"openkernels: eager replay is off (its C extension could not be built: "
                    f"{_State.failed.splitlines()[0][:300]})",
                    RuntimeWarning,
                    stacklevel=4,
                )
    return _State.module


def available() -> bool:
    """Whether the C extension could be built here (builds it)."""
    return _module() is not None


# ---------------------------------------------------------------------------- recording

_VIEWS_AND_ALLOCATIONS = {
    "empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
    "new_empty_strided.default", "view.default", "view.dtype", "_unsafe_view.default", "as_strided.default",
    "t.default",
    "transpose.int", "permute.default", "expand.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims",
    "squeeze.default", "select.int", "slice.Tensor", "alias.default", "detach.default", "split.Tensor",
    "split_with_sizes.default", "unbind.int", "unflatten.int", "view_as_real.default", "view_as_complex.default",
    "lift_fresh.default",  # torch.tensor(python data): a constant, used by a kernel only if persistent
}  # fmt: skip
_ALLOCATIONS = {"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
                "new_empty_strided.default"}  # fmt: skip


class _Watch(TorchDispatchMode):
    """Sees every aten op of the recorded call: keeps its allocations, flags anything else."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.recording
        name = f"{func._opname}.{func._overloadname}"
        if rec.steps is not None:  # a CPU call: every op, replayed as a program if one computes
            rec.steps.append(("aten", func, args, kwargs, out))
            if name not in _VIEWS_AND_ALLOCATIONS and rec.computes is None:
                rec.computes = f"aten.{name}"
        elif name not in _VIEWS_AND_ALLOCATIONS:
            rec.refuse(f"aten.{name}")
        if name in _ALLOCATIONS and isinstance(out, torch.Tensor):
            rec.allocations.append(out)
        return out


class _Recording:
    def __init__(self, cuda: bool) -> None:
        self.thread = threading.get_ident()
        self.allocations: list[torch.Tensor] = []
        self.launches: list[tuple] = []  # ("cpu", fn address, [(is_pointer, value)]) or ("cuda", ...)
        self.why_not: str | None = None
        self.cuda = cuda
        self.triton_launches = 0  # counted by Triton's launch hook, whoever launched
        self.functions: list[tuple] = []  # (ctx, outputs, materialize_grads) of each opdef autograd forward
        # CPU calls: every aten op and kernel launch in order (a call that computes with aten
        # replays them all, `_program`); computes: the first aten op that is not a view or an
        # allocation. CUDA calls keep refusing those (an aten launch would wait on nothing).
        self.steps: list[tuple] | None = None if cuda else []
        self.computes: str | None = None

    def refuse(self, why: str) -> None:
        if self.why_not is None:
            self.why_not = why

    def count(self, *args: Any) -> None:
        if threading.get_ident() == self.thread:
            self.triton_launches += 1


_PERSISTENT: dict[int, torch.Tensor] = {}  # data_ptr -> a tensor that lives as long as the process


def persistent(t: torch.Tensor) -> torch.Tensor:
    """Declare `t` a constant for the life of the process (a lookup table a kernel reads):
    a recorded launch may then pass its address as a constant. Held here, never freed."""
    _PERSISTENT.setdefault(t.data_ptr(), t)
    return t


def _recording() -> _Recording | None:
    return getattr(_State.local, "recording", None)


def reads_host_values(what: str) -> None:
    """Say that the running body reads tensor values on the host (`.tolist()`, numpy views:
    reads no recording sees): a recording of the call in progress is refused, since those
    values would be baked into its launches. Free when nothing records."""
    rec = getattr(_State.local, "recording", None)
    if rec is not None:
        rec.refuse(f"reads {what} on the host")


def observe_function(ctx: Any, outputs: Any, materialize_grads: bool) -> None:
    """An openkernels autograd.Function's forward ran (opdef): a recording under autograd
    keeps its context, to record the backward from it. Free when nothing records."""
    rec = getattr(_State.local, "recording", None)
    if rec is not None:
        rec.functions.append((ctx, outputs if type(outputs) is tuple else (outputs,), materialize_grads))


def observe_cpu(
    packed: int | None, args: tuple, pointer: tuple[bool, ...], doubles: tuple[bool, ...]
) -> None:
    """A CPU kernel call of the recording in this thread: `packed` is its packed entry's address
    (None: it has none), `pointer` / `doubles` flag each argument's kind."""
    rec = _recording()
    if rec is None:
        return
    if not packed:
        rec.refuse("a CPU kernel without a packed entry")
        return
    slots = []
    for value, is_pointer, is_double in zip(args, pointer, doubles, strict=True):
        if is_double:
            slots.append((False, struct.unpack("<q", struct.pack("<d", float(value)))[0]))
        else:
            slots.append((is_pointer, int(value or 0)))
    rec.launches.append(("cpu", packed, slots))
    if rec.steps is not None:
        rec.steps.append(("launch", len(rec.launches) - 1))


_FLOAT_PACK = {"fp32": "<f", "f32": "<f", "fp64": "<d", "fp16": "<e"}


# Triton's TMA element types as the kernel's metadata names them -> the driver's enum
# (triton/backends/nvidia/driver.py, TMA_DTYPE_DEVICE_TO_HOST: the two differ at 8-10).
_TMA_DTYPE_TO_DRIVER = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
TENSOR_MAP_BYTES = 128  # a slot of this size is a CUtensorMap the replay encodes per call
# Replay launches with host TMA descriptors (the Gluon kernels') by encoding their tensor
# maps per call in C++ (checked bitwise against the Python path on an H100 by
# benchmarks/gpu/check_replay_gpu.py); OPENKERNELS_REPLAY_TENSOR_MAPS=0 refuses them instead.
TENSOR_MAPS = os.environ.get("OPENKERNELS_REPLAY_TENSOR_MAPS", "1") not in ("0", "")


def _tensor_map_slots(desc: Any, meta: dict | None) -> list | str:
    """A host TMA descriptor argument as the launcher expands it (driver.make_tensordesc_arg):
    the CUtensorMap, then the descriptor's shape (i32) and strides (i64). The map's slot
    carries what cuTensorMapEncodeTiled needs besides the address, as fillTMADescriptor
    passes it (innermost dimension first, strides in bytes, the box from the kernel's
    metadata): (driver dtype, rank, swizzle, out-of-bounds fill, dims..., strides..., box...).
    A string: why such a launch cannot be replayed."""
    base = getattr(desc, "base", None)
    if meta is None or not isinstance(base, torch.Tensor):
        return "a tensor descriptor the kernel takes apart (no TMA metadata)"
    if meta.get("fp4_padded"):
        return "an fp4-padded tensor descriptor"
    shape, strides, box = list(desc.shape), list(desc.strides), list(meta["block_size"])
    rank, elem = len(shape), int(meta["elem_size"])
    if not 1 <= rank <= 5 or len(box) != rank or strides[-1] != 1:
        return "a tensor descriptor of an unexpected rank or layout"
    spec = (_TMA_DTYPE_TO_DRIVER[int(meta["elem_type"])], rank, int(meta["swizzle"]),
            1 if desc.padding == "nan" else 0, *shape[::-1], *(elem * s for s in strides[-2::-1]),
            *box[::-1])  # fmt: skip
    return [(True, base.data_ptr(), TENSOR_MAP_BYTES, spec)] + [
        (False, int(v), 8) for v in (*shape, *strides)
    ]


def observe_triton(compiled: Any, grid: tuple, values: list) -> None:
    """A Triton launch through `openkernels.shared.launch` of the recording in this thread."""
    rec = _recording()
    if rec is None:
        return
    if compiled is False or not rec.cuda:
        rec.refuse(
            "a Triton kernel that needs scratch memory" if compiled is False else "a Triton launch on CPU"
        )
        return
    try:
        meta = compiled.metadata
        signature = list(compiled.src.signature.values())
        descriptors = iter(getattr(meta, "tensordesc_meta", None) or ())
        slots = []
        for ty, value in zip(signature, values, strict=True):
            if ty == "constexpr":
                continue
            if isinstance(ty, str) and ty.startswith("tensordesc") and TENSOR_MAPS:
                expanded = _tensor_map_slots(value, next(descriptors, None))
                if isinstance(expanded, str):
                    rec.refuse(expanded)
                    return
                slots += expanded
                continue
            if not isinstance(ty, str) or ty.startswith("tensordesc") or ty == "nvTmaDesc":
                rec.refuse(f"a Triton parameter of type {ty}")
                return
            if ty[0] == "*":
                if value is None:
                    slots.append((False, 0, 8))
                elif isinstance(value, torch.Tensor):
                    slots.append((True, value.data_ptr(), 8))
                else:
                    rec.refuse("a Triton pointer passed as an int")
                    return
            elif ty in _FLOAT_PACK:
                raw = struct.pack(_FLOAT_PACK[ty], float(value))
                slots.append((False, int.from_bytes(raw, "little"), len(raw)))
            elif ty == "bf16":
                raw = struct.pack("<f", float(value))[2:]
                slots.append((False, int.from_bytes(raw, "little"), 2))
            else:
                slots.append((False, int(value), 8))
        grid3 = (*grid, 1, 1)[:3]
        rec.launches.append(("cuda", int(compiled.function), grid3, meta.num_warps, getattr(meta, "num_ctas", 1),
                             meta.shared, int(bool(getattr(meta, "launch_cooperative_grid", False))),
                             int(bool(getattr(meta, "launch_pdl", False))), slots))  # fmt: skip
    except (AttributeError, TypeError, ValueError) as error:
        rec.refuse(f"an unreadable Triton launch ({error})")


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors of a call in the C key's order: positional, then keyword, tuples inside."""
    out: list[torch.Tensor] = []

    def add(v: Any, depth: int = 0) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) is tuple and depth < 2:
            for item in v:
                add(item, depth + 1)

    for v in args:
        add(v)
    for v in kwargs.values():
        add(v)
    return out


def _exact_buffer(t: torch.Tensor) -> bool:
    """t starts its storage and covers all of it (so a fresh tensor of its shape replaces it)."""
    if t.storage_offset() != 0:
        return False
    if t.numel() == 0:
        return t.untyped_storage().nbytes() == 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() == extent * t.element_size()


def _entry(rec: _Recording, args: tuple, kwargs: dict, result: Any) -> tuple | str:
    """(outputs, returns, is_tuple, launches, buffers): Table.add's arguments and the tensor
    of each output, or why the call cannot be replayed. outputs: every tensor a replay
    allocates (results and scratch) or returns as given (an input); returns: which of them
    the call returns."""
    if rec.why_not:
        return rec.why_not
    if rec.computes is not None:  # a program (`_program`), not allocations and launches
        return rec.computes
    if rec.triton_launches != sum(1 for seen in rec.launches if seen[0] == "cuda"):
        return "a Triton kernel launched around openkernels.shared.launch"
    if isinstance(result, torch.Tensor):
        returned, is_tuple = [result], False
    elif type(result) is tuple and result and all(isinstance(t, torch.Tensor) for t in result):
        returned, is_tuple = list(result), True
    elif result is None and rec.launches:  # in place: what it computes, its launches write into its inputs
        returned, is_tuple = [], False
    else:
        return "a result that is not a tensor or a tuple of tensors"
    built = _build(rec, _tensors(args, kwargs), returned)
    if isinstance(built, str):
        return built
    outputs, returns, launches, buffers = built
    return outputs, returns, is_tuple, launches, buffers


def _build(rec: _Recording, inputs: list[torch.Tensor], returned: list[torch.Tensor | None]) -> tuple | str:
    """(outputs, returns, launches, buffers) of a recording whose launches take `inputs` and
    whose results are `returned` (None: no result there, returns -1: a backward's gradient
    nobody asked for)."""
    by_pointer = {t.data_ptr(): i for i, t in reversed(list(enumerate(inputs)))}
    # Inputs that share an address map to the first of them; the key records that sharing.
    buffer_of: dict[int, int] = {}  # storage address -> buffer index
    outputs = []  # (alias, sizes, strides, dtype, device type, device index)
    buffers: list[torch.Tensor] = []
    returns = []
    for t in returned:
        if t is None:
            returns.append(-1)
            continue
        again = next((returns[k] for k, x in enumerate(returned[: len(returns)]) if x is t), None)
        if again is not None:  # the same tensor twice (a backward's gradient of x and residual)
            returns.append(again)
            continue
        alias = next((i for i, x in enumerate(inputs) if x is t), None)
        if alias is not None:
            outputs.append((alias, (), (), 0, 0, 0))
            buffers.append(t)
            returns.append(len(outputs) - 1)
            continue
        base = t.untyped_storage().data_ptr()
        if any(x.untyped_storage().data_ptr() == base for x in inputs) or base in buffer_of:
            return "a result that shares memory with an input or another result"
        if not _exact_buffer(t):
            return "a result that is a view into a larger buffer"
        buffer_of[base] = len(outputs)
        outputs.append(
            (-1, tuple(t.shape), t.stride(), _dtype_code(t.dtype), _device_type(t), t.device.index or 0)
        )
        buffers.append(t)
        returns.append(len(outputs) - 1)
    for t in rec.allocations:  # scratch: allocated, passed to kernels, not returned
        base = t.untyped_storage().data_ptr()
        if base in buffer_of or not _exact_buffer(t):
            continue
        buffer_of[base] = len(outputs)
        outputs.append(
            (-1, tuple(t.shape), t.stride(), _dtype_code(t.dtype), _device_type(t), t.device.index or 0)
        )
        buffers.append(t)
    launches = []
    for seen in rec.launches:
        raw = seen[-1]
        slots = []
        maps = []  # the launch's tensor maps: a map slot's constant is its index here
        for item in raw:
            is_pointer, value = item[0], item[1]
            size = item[2] if len(item) > 2 else 8
            bits = 0
            if size == TENSOR_MAP_BYTES:
                bits = len(maps)
                maps.append(item[3])
                if value not in by_pointer and value not in buffer_of:
                    return "a tensor descriptor over memory that is neither an input nor an allocation of the call"
            if not is_pointer or value == 0:
                slots.append((0, 0, _signed(value), size))
            elif value in by_pointer:
                slots.append((1, by_pointer[value], bits, size))
            elif value in buffer_of:
                slots.append((2, buffer_of[value], bits, size))
            elif value in _PERSISTENT:
                slots.append((0, 0, _signed(value), size))
            else:
                return "a kernel pointer that is neither an input nor an allocation of the call"
        if seen[0] == "cpu":
            launches.append((0, seen[1], (1, 1, 1), 0, 1, 0, 0, 0, slots))
        else:
            launches.append((1, *seen[1:-1], slots, *((maps,) if maps else ())))
    # A result no recorded launch wrote was made some way the recording cannot see (the
    # Triton interpreter, a launch around the observed paths): not replayable.
    written = {slot[1] for launch in launches for slot in launch[8] if slot[0] == 2}
    for r, t in zip(returns, returned):
        if r >= 0 and outputs[r][0] < 0 and t.numel() > 0 and r not in written:
            return "a result that no recorded launch wrote"
    return outputs, returns, launches, buffers


def _program(
    rec: _Recording, inputs: list[torch.Tensor], result: Any, gradients: bool = False
) -> tuple | str:
    """A CPU call that computed with aten ops, as Table.add's arguments: (outputs (none),
    returns, is_tuple, launches, None, program, values). The program replays every recorded
    aten op through the dispatcher and every kernel launch, in order, over a table of values
    (`values`: the call's tensors, then each op's tensor outputs); launch slots and returns
    index that table. `gradients`: a backward's list of gradients, None for no gradient
    (returned as -1). Or why it cannot be replayed."""
    if rec.why_not:
        return rec.why_not
    if gradients:
        returned, is_tuple = list(result), True
    elif isinstance(result, torch.Tensor):
        returned, is_tuple = [result], False
    elif type(result) is tuple and result and all(isinstance(t, torch.Tensor) for t in result):
        returned, is_tuple = list(result), True
    elif result is None:
        returned, is_tuple = [], False
    else:
        return "a result that is not a tensor or a tuple of tensors"
    values: list[torch.Tensor] = list(inputs)
    index: dict[int, int] = {}
    for i, t in enumerate(inputs):
        index.setdefault(id(t), i)
    steps: list[tuple] = []
    launches: list[tuple] = []
    for step in rec.steps or ():
        if step[0] == "launch":
            slots = _program_slots(rec.launches[step[1]][2], values)
            if slots is None:
                return "a kernel pointer that is not a tensor of the call"
            launches.append((0, rec.launches[step[1]][1], (1, 1, 1), 0, 1, 0, 0, 0, slots))
            steps.append(("launch", len(launches) - 1))
            continue
        _, func, args, kwargs, out = step
        schema = func._schema
        name = f"aten.{func._opname}.{func._overloadname}"
        if any(str(r.type) != "Tensor" for r in schema.returns):
            return f"{name}, whose results are not all tensors"
        encoded = []
        for i, arg in enumerate(schema.arguments):
            if i < len(args):
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            elif arg.has_default_value():
                value = arg.default_value
            else:
                return f"{name} without its argument {arg.name}"
            if isinstance(value, (bool, int, float)) and str(arg.type) in ("Tensor", "Tensor?"):
                item = ("n", value)  # a Python number where a tensor goes: a wrapped number
            else:
                item = _program_argument(value, index)
            if item is None:
                return f"{name} on a tensor that is neither an argument nor made by the call"
            encoded.append(item)
        outputs = []
        for o in out if isinstance(out, tuple) else (out,):
            j = index.get(id(o))
            if j is None:  # a new tensor (an in-place op returns its argument: the same value)
                j = index[id(o)] = len(values)
                values.append(o)
            outputs.append(j)
        steps.append(("aten", schema.name, schema.overload_name, encoded, outputs))
    returns = []
    for t in returned:
        j = -1 if t is None and gradients else index.get(id(t))
        if j is None:
            return "a result the recorded ops did not make"
        returns.append(j)
    return [], returns, is_tuple, launches, None, (len(values), steps), values


def _program_argument(value: Any, index: dict[int, int]) -> tuple | None:
    """("t", value index), ("tl", [value indices]) or ("o", a constant); None: a tensor that
    is not a value of the program (a persistent table is a constant)."""
    if isinstance(value, torch.Tensor):
        j = index.get(id(value))
        if j is not None:
            return ("t", j)
        return ("o", value) if _PERSISTENT.get(value.data_ptr()) is value else None
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        js = [index.get(id(v)) for v in value]
        return None if None in js else ("tl", js)
    return ("o", value)


def _program_slots(raw: list, values: list[torch.Tensor]) -> list | None:
    """A CPU launch's slots over the program's values (a pointer: the first value that starts
    there, views included), or None."""
    slots = []
    for is_pointer, value in raw:
        if not is_pointer or value == 0:
            slots.append((0, 0, _signed(value), 8))
            continue
        j = next((i for i, t in enumerate(values) if t.data_ptr() == value), None)
        if j is not None:
            slots.append((2, j, 0, 8))
        elif value in _PERSISTENT:
            slots.append((0, 0, _signed(value), 8))
        else:
            return None
    return slots


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_DTYPE_CODES: dict[torch.dtype, int] = {}


def _dtype_code(dtype: torch.dtype) -> int:
    """c10::ScalarType's number of a torch dtype (read once from the extension's own key)."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        key = _State.module.key((torch.empty(0, dtype=dtype),), None)
        code = _DTYPE_CODES[dtype] = key[1]
    return code


def _device_type(t: torch.Tensor) -> int:
    return 1 if t.device.type == "cuda" else 0  # c10::DeviceType: kCPU 0, kCUDA 1


class _Replayable:
    """One public function's table and its recording."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.table: Any = None
        self.refusals: dict[str, int] = {}
        self.programs = 0  # entries recorded as programs (CPU calls that compute with aten)
        self.generation = dispatch._generation  # the registry its entries were recorded under

    def start(self) -> bool:
        if self.table is None:
            module = _module()
            if module is None:
                return False
            self.table = module.Table()
        return True

    def record(self, args: tuple, kwargs: dict) -> Any:
        inputs = _tensors(args, kwargs)
        cuda = any(t.is_cuda for t in inputs)
        rec = _Recording(cuda)
        with _watching(rec):
            result = self.fn(*args, **kwargs)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        plan = program = None
        if rec.computes is not None:  # a CPU call computing with aten: a program of its ops
            entry = _program(rec, inputs, result)
            if not isinstance(entry, str):
                program = entry[5]
        else:
            entry = _entry(rec, args, kwargs, result)
        if not isinstance(entry, str) and grad:
            plan = _grad_plan(rec, inputs, result if isinstance(result, tuple) else (result,), entry)
            if isinstance(plan, str):
                entry = plan
        if cuda and torch.version.hip is not None:
            entry = "a ROCm call (the C side launches through the CUDA driver only)"
        if not isinstance(entry, str) and not self.table.add(args, kwargs, *entry[:4], plan, program):
            entry = "no CUDA driver to launch with"  # the key was built for the recording
        if isinstance(entry, str):
            self.refusals[entry] = self.refusals.get(entry, 0) + 1
            self.table.refuse(args, kwargs)
        elif program is not None:
            self.programs += 1
        return result


@contextlib.contextmanager
def _watching(rec: _Recording) -> Iterator[None]:
    """Watch this thread's aten ops, CPU kernel calls and Triton launches into `rec`."""
    hooks = None
    if "triton" in sys.modules:  # count every Triton launch, however it was made
        from triton import knobs

        hooks = knobs.runtime.launch_enter_hook
        hooks.add(rec.count)
    _State.local.recording = rec
    if rec.cuda:
        launch.observer = observe_triton
    try:
        with _Watch(rec):
            yield
    finally:
        _State.local.recording = None
        if rec.cuda:
            launch.observer = None
        if hooks is not None:
            hooks.remove(rec.count)


# ---------------------------------------------------------------------------- autograd


class _SavedContext:
    """What an opdef backward reads from its ctx, for the Python backward of a replayed node."""

    __slots__ = ("needs_input_grad", "saved_tensors", "steering", "values")

    def __init__(self, saved_tensors: tuple, values: Any, needs_input_grad: tuple, steering: Any) -> None:
        self.saved_tensors = saved_tensors
        self.values = values
        self.needs_input_grad = needs_input_grad
        self.steering = steering


def _argument_of(node: Any, nr: int, inputs: list[torch.Tensor]) -> int | None:
    """The argument tensor whose gradient edge is (node, nr)."""
    for j, t in enumerate(inputs):
        if not t.requires_grad:
            continue
        if t.grad_fn is None:
            if nr == 0 and getattr(node, "variable", None) is t:  # a leaf's AccumulateGrad
                return j
        elif node is t.grad_fn and nr == t.output_nr:
            return j
    return None


def _saved_ref(
    t: torch.Tensor, inputs: list[torch.Tensor], buffers: list[torch.Tensor], outputs: list | None
) -> tuple | None:
    """(1, argument index) or (2, output buffer index) of a tensor the forward saved; a
    program's buffers are its values (`outputs` None), every one of them made by the call."""

    def same(x: torch.Tensor) -> bool:
        return (x.data_ptr() == t.data_ptr() and x.dtype == t.dtype and x.shape == t.shape
                and x.stride() == t.stride())  # fmt: skip

    for j, x in enumerate(inputs):
        if x is t or same(x):
            return 1, j
    for i, b in enumerate(buffers):
        if (outputs is None or outputs[i][0] < 0) and (b is t or same(b)):
            return 2, i
    return None


def _grad_plan(
    rec: _Recording, inputs: list[torch.Tensor], returned: tuple, entry: tuple
) -> tuple | str | None:
    """Table.add's `grad` for a call recorded under autograd (None: its results need no graph
    node), or why it cannot be replayed. Records the backward now, on the saved tensors and a
    dense gradient of zeros per differentiable result; the results are thrown away."""
    outputs, returns, _, _, buffers = entry[:5]
    program = len(entry) > 5
    if program:  # saved tensors and results index the program's values
        outputs, buffers = None, entry[6]
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in returned):
        return None
    if len(rec.functions) != 1:
        return "a call under autograd that is not one openkernels autograd function"
    ctx, function_outputs, materialize = rec.functions[0]
    position = {id(o): i for i, o in enumerate(function_outputs)}
    differentiable, output_index = [], []
    for t in returned:
        i = position.get(id(t))
        if i is None or (t.requires_grad and t.grad_fn is not ctx):
            return "a result under autograd that is not an output of the op's autograd function"
        if program and t.requires_grad and t._base is not None:
            return "a differentiable result that is a view"
        differentiable.append(t.requires_grad)
        output_index.append(i)
    edges, edge_args = [], []
    for arg, (node, nr) in enumerate(ctx.next_functions):
        if node is None:
            continue
        j = _argument_of(node, nr, inputs)
        if j is None or j in edges:
            return "an autograd input that is not an argument of the call, or one passed twice"
        edges.append(j)
        edge_args.append(arg)
    saved_tensors = ctx.saved_tensors
    diff_buffers = {returns[r] for r, d in enumerate(differentiable) if d}
    saved, positions, saved_inputs = [], [], []
    for pos, t in enumerate(saved_tensors):
        if t is None:
            continue
        ref = _saved_ref(t, inputs, buffers, outputs)
        if ref is None:
            return "a saved tensor that is neither an argument nor a buffer of the call"
        saved.append((*ref, int(ref[0] == 2 and ref[1] in diff_buffers)))
        positions.append(pos)
        saved_inputs.append(t)
    grads, gradient_inputs = [], []
    function_grads: list[torch.Tensor | None] = [None] * len(function_outputs)
    for r, t in enumerate(returned):
        if not differentiable[r]:
            grads.append((0, (), (), 0, 1))
            continue
        g = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        function_grads[output_index[r]] = g
        gradient_inputs.append(g)
        grads.append((1, tuple(g.shape), g.stride(), _dtype_code(g.dtype), int(g.data_ptr() % 16 == 0)))
    if materialize:
        function_grads = [
            torch.zeros_like(o) if g is None else g for g, o in zip(function_grads, function_outputs)
        ]
    backward = ctx._forward_cls.backward
    # The backward reads the very tensor objects listed here (a program finds its inputs by
    # identity; ctx.saved_tensors may unpack new ones).
    full: list[torch.Tensor | None] = [None] * len(saved_tensors)
    for p, t in zip(positions, saved_inputs):
        full[p] = t
    saved_ctx = _SavedContext(tuple(full), ctx.values, ctx.needs_input_grad, ctx.steering)
    brec = _Recording(rec.cuda)
    try:
        with _watching(brec), torch.no_grad():
            result = backward(saved_ctx, *function_grads)
    except Exception as error:  # the recording is refused; the call itself already ran
        return f"a backward that failed when recorded ({type(error).__name__})"
    if brec.why_not:
        return brec.why_not
    if brec.triton_launches != sum(1 for seen in brec.launches if seen[0] == "cuda"):
        return "a Triton kernel launched around openkernels.shared.launch"
    result = result if type(result) is tuple else (result,)
    edge_grads = [result[a] if a < len(result) else None for a in edge_args]
    if any(g is not None and not isinstance(g, torch.Tensor) for g in edge_grads):
        return "a backward result that is not a tensor or None"
    b_program = None
    if brec.computes is not None:  # a CPU backward computing with aten: a program of its ops
        built = _program(brec, [*saved_inputs, *gradient_inputs], edge_grads, gradients=True)
        if isinstance(built, str):
            return built
        b_outputs, b_returns, _, b_launches, _, b_program, _ = built
    else:
        built = _build(brec, [*saved_inputs, *gradient_inputs], edge_grads)
        if isinstance(built, str):
            return built
        b_outputs, b_returns, b_launches, _ = built
    fallback = _python_backward(ctx, backward, len(saved_tensors), positions, output_index,
                                function_outputs, materialize, edge_args)  # fmt: skip
    return (type(ctx).__name__, [int(d) for d in differentiable], edges, saved, grads, b_outputs, b_returns,
            b_launches, fallback, b_program, materialize)  # fmt: skip


def _python_backward(ctx: Any, backward: Callable, n_saved: int, positions: list[int], output_index: list[int],
                     function_outputs: tuple, materialize: bool, edge_args: list[int]) -> Callable:  # fmt: skip
    """The Python backward a replayed node calls for gradients it has no recording for
    (missing, other strides, create_graph=True): the op's own backward, as the Python path
    would have run it. Holds no tensor of the call."""
    values, needs, steering = ctx.values, ctx.needs_input_grad, ctx.steering
    shapes = [(o.shape, o.dtype, o.device) for o in function_outputs]

    def run(saved: tuple, grads: tuple) -> tuple:
        full: list[torch.Tensor | None] = [None] * n_saved
        for p, t in zip(positions, saved, strict=True):
            full[p] = t
        function_grads: list[torch.Tensor | None] = [None] * len(shapes)
        for i, g in zip(output_index, grads, strict=True):
            function_grads[i] = g
        if materialize:
            function_grads = [torch.zeros(s, dtype=d, device=v) if g is None else g
                              for g, (s, d, v) in zip(function_grads, shapes)]  # fmt: skip
        result = backward(_SavedContext(tuple(full), values, needs, steering), *function_grads)
        result = result if type(result) is tuple else (result,)
        return tuple(result[a] if a < len(result) else None for a in edge_args)

    return run


def replayable(fn: F) -> F:
    """Wrap a public function so that its calls are recorded and replayed (module docstring)."""
    r = _Replayable(fn)
    _State.replayables.append(r)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        mode = _State.mode
        if torch.compiler.is_compiling() or mode == "off":
            return fn(*args, **kwargs)
        # "cpu": a CUDA call costs one attribute read here (its first tensor decides).
        if mode == "cpu" and args and getattr(args[0], "is_cuda", False):
            return fn(*args, **kwargs)
        if not dispatch.unsteered() or getattr(_State.local, "recording", None) is not None:
            return fn(*args, **kwargs)  # steered, or inside another call's recording: run it
        table = r.table
        if table is None and not r.start():
            return fn(*args, **kwargs)
        if r.generation != dispatch._generation:  # implementations changed since recorded
            r.table.clear()
            r.generation = dispatch._generation
        out = r.table.call(args, kwargs)
        if out is _MISS:
            return r.record(args, kwargs)
        if out is _SKIP:
            return fn(*args, **kwargs)
        return out

    call._replay = r  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


_MISS: Any = object()  # the extension's sentinels, once it is built
_SKIP: Any = object()


def stats(fn: Callable[..., Any]) -> dict[str, Any]:
    """A replayable function's entries, replayed calls and why recordings were refused."""
    r: _Replayable = fn._replay  # type: ignore[attr-defined]
    if r.table is None:
        return {"entries": 0, "hits": 0, "refused": dict(r.refusals), "programs": r.programs}
    return {
        "entries": r.table.size(),
        "hits": r.table.hits(),
        "refused": dict(r.refusals),
        "programs": r.programs,
    }


def entry_kind(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """How a replayable function's call with these arguments replays: "launches"
    (allocations and kernel launches), "program" (a CPU body's aten ops too), "refused", or
    None (not recorded yet, or replay unavailable). Tests and diagnostics."""
    r: _Replayable = fn._replay  # type: ignore[attr-defined]
    return None if r.table is None else r.table.kind(args, kwargs)


def all_stats() -> dict[str, dict[str, Any]]:
    """`stats` of every replayable body that has run (public functions and the opdef
    forward/backward bodies), by qualified name."""
    out: dict[str, dict[str, Any]] = {}
    for r in _State.replayables:
        if r.table is not None or r.refusals:
            name = f"{r.fn.__module__}.{r.fn.__qualname__}"
            while name in out:  # the same body wrapped twice (an op's direct and autograd paths)
                name += "'"
            out[name] = stats(_Handle(r))
    return out


class _Handle:
    __slots__ = ("_replay",)

    def __init__(self, r: _Replayable) -> None:
        self._replay = r


# ---------------------------------------------------------------------------- CPU kernels


class _ObservedFunction:
    __slots__ = ("doubles", "fn", "packed", "pointer")

    def __init__(self, fn: Any, packed: int | None) -> None:
        self.fn = fn
        self.packed = packed
        self.pointer = tuple(t is ctypes.c_void_p for t in fn.argtypes)
        self.doubles = tuple(t in (ctypes.c_double, ctypes.c_float) for t in fn.argtypes)

    def __call__(self, *args: Any) -> Any:
        if getattr(_State.local, "recording", None) is not None:
            observe_cpu(self.packed, args, self.pointer, self.doubles)
        return self.fn(*args)


class _ObservedLibrary:
    def __init__(self, lib: ctypes.CDLL, names: tuple[str, ...]) -> None:
        for name in names:
            fn = getattr(lib, name)
            try:
                packed = ctypes.cast(getattr(lib, f"{name}_packed"), ctypes.c_void_p).value
            except AttributeError:
                packed = None
            setattr(self, name, _ObservedFunction(fn, packed))


def observe_library(lib: ctypes.CDLL, names: tuple[str, ...]) -> Any:
    """`lib` with its functions `names` (argtypes declared) seen by recordings: a kernel `f` is
    replayable when the library exports `int f_packed(const int64_t* args)` (every argument in
    one 64-bit slot, doubles as their bits) that calls it."""
    return _ObservedLibrary(lib, names)
