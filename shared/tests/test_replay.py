"""openkernels.shared.replay: recorded calls replayed from C++ give the Python path's results,
and every call the recording cannot vouch for takes the Python path."""

from __future__ import annotations

import ctypes
import threading
import types

import pytest
import torch

from openkernels.shared import cpu_build, dispatch, replay
from openkernels.shared.dev.testing.threads import run_in_threads

pytestmark = pytest.mark.skipif(not cpu_build.compiler_available(), reason="no C++ compiler")

# y = x * scale + shift over n floats; the packed entry takes every argument in a 64-bit slot.
_SOURCE = r"""
#include <cstdint>
#include <cstring>
extern "C" int toy_affine(const float* x, float* y, int64_t n, double scale, double shift) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] * scale + shift);
  return 0;
}
extern "C" int toy_affine_packed(const int64_t* a) {
  double scale, shift;
  std::memcpy(&scale, &a[3], 8);
  std::memcpy(&shift, &a[4], 8);
  return toy_affine(reinterpret_cast<const float*>(a[0]), reinterpret_cast<float*>(a[1]), a[2], scale, shift);
}
extern "C" int toy_nopack(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i];
  return 0;
}
"""


@pytest.fixture(scope="module")
def lib(toy_library):
    p, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    signatures = {"toy_affine": [p, p, i64, f64, f64], "toy_nopack": [p, p, i64]}
    return toy_library(_SOURCE, "openkernels_toy_replay", signatures)


@pytest.fixture(autouse=True)
def cpu_mode():
    before = replay.mode()
    replay.set_mode("cpu")
    yield
    replay.set_mode({"off": "0", "cpu": "cpu", "all": "all"}[before])


def _affine(lib):
    calls = []

    @replay.replayable
    def affine(x: torch.Tensor, scale: float = 2.0, *, shift: float = 0.0, out: torch.Tensor | None = None):
        calls.append(1)  # Python ran
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("affine: contiguous float32 only")
        y = torch.empty_like(x) if out is None else out
        lib.toy_affine(x.data_ptr(), y.data_ptr(), x.numel(), scale, shift)
        return y

    return affine, calls


def test_a_replayed_call_computes_on_its_own_inputs_into_a_fresh_output(lib):
    affine, calls = _affine(lib)
    x = torch.randn(3, 5)
    affine(x, 3.0, shift=1.0)  # the key's first call: marked seen
    assert replay.stats(affine)["entries"] == 0
    first = affine(x, 3.0, shift=1.0)  # its second: recorded
    assert len(calls) == 2 and replay.stats(affine)["entries"] == 1
    for _ in range(3):
        x2 = torch.randn(3, 5)
        y = affine(x2, 3.0, shift=1.0)
        torch.testing.assert_close(y, x2 * 3.0 + 1.0, rtol=0, atol=1e-6)
        assert y.data_ptr() != first.data_ptr() and y.shape == (3, 5) and y.dtype == torch.float32
    assert len(calls) == 2 and replay.stats(affine)["hits"] == 3


@pytest.mark.parametrize(
    "change",
    [
        lambda x: ((torch.randn(4, 5),), {"shift": 1.0}),  # shape
        lambda x: ((x, 4.0), {"shift": 1.0}),  # a float's value
        lambda x: ((x, 3.0), {"shift": 2.0}),  # a keyword's value
        lambda x: ((x, 3.0), {}),  # a keyword left out
        lambda x: ((torch.randn(5, 3).t(),), {"shift": 1.0}),  # strides (and the Python check)
        lambda x: ((torch.randn(17)[1:].view(4, 4),), {"shift": 1.0}),  # alignment of the address
    ],
)
def test_any_change_of_the_key_runs_python_again(lib, change):
    affine, calls = _affine(lib)
    x = torch.randn(3, 5)
    for _ in range(3):  # seen, recorded, replayed
        affine(x, 3.0, shift=1.0)
    args, kwargs = change(x)
    try:
        y = affine(*args, **kwargs)
    except ValueError:
        y = None
    assert len(calls) == 3
    if y is not None:
        scale = args[1] if len(args) > 1 else 2.0
        torch.testing.assert_close(y, args[0] * scale + kwargs.get("shift", 0.0), rtol=0, atol=1e-6)


def test_out_is_returned_as_given(lib):
    affine, calls = _affine(lib)
    x, out = torch.randn(8), torch.empty(8)
    affine(x, out=out)
    affine(x, out=out)
    x2, out2 = torch.randn(8), torch.empty(8)
    assert affine(x2, out=out2) is out2
    torch.testing.assert_close(out2, x2 * 2.0)
    assert len(calls) == 2


def test_in_place_calls_returning_none_replay_into_their_inputs(lib):
    # A KV-cache append: launches write into the arguments and nothing is returned.
    calls = []

    @replay.replayable
    def scale_in_place(x: torch.Tensor, y: torch.Tensor) -> None:
        calls.append(1)
        lib.toy_affine(x.data_ptr(), y.data_ptr(), x.numel(), 3.0, 1.0)

    for _ in range(4):
        x, y = torch.randn(6), torch.empty(6)
        assert scale_in_place(x, y) is None
        torch.testing.assert_close(y, x * 3 + 1)
    assert len(calls) == 2 and replay.stats(scale_in_place)["hits"] == 2

    @replay.replayable
    def does_nothing(x: torch.Tensor) -> None:  # no launch: nothing to replay, refused
        calls.append(1)

    for _ in range(3):
        does_nothing(torch.randn(2))
    assert replay.stats(does_nothing)["refused"] == {"a result that is not a tensor or a tuple of tensors": 1}


def test_errors_are_not_recorded(lib):
    affine, calls = _affine(lib)
    x = torch.randn(4, dtype=torch.float64)
    for _ in range(2):
        with pytest.raises(ValueError):
            affine(x)
    assert len(calls) == 2 and replay.stats(affine)["entries"] == 0


def test_cpu_calls_that_compute_in_torch_replay_as_programs(lib):
    """A CPU body with aten computations replays them through the dispatcher, in order with
    its launches: views (a kernel pointer into the middle of a tensor included), in-place ops,
    numbers passed for tensors."""
    calls = []

    @replay.replayable
    def shifted(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        y = torch.empty_like(x)
        lib.toy_affine(x.data_ptr(), y.data_ptr(), x.numel(), 2.0, 0.0)
        z = y + 1  # computed by aten, between two launches
        tail = z[1:]  # a view: the next launch reads from the middle of z
        out = torch.empty(x.numel() - 1)
        lib.toy_affine(tail.data_ptr(), out.data_ptr(), out.numel(), 1.0, 0.5)
        out.mul_(3)
        return out

    for _ in range(4):
        x = torch.randn(6)
        torch.testing.assert_close(shifted(x), ((x * 2 + 1)[1:] + 0.5) * 3)
    assert len(calls) == 2
    assert replay.stats(shifted) == {"entries": 1, "hits": 2, "refused": {}, "programs": 1}


def test_programs_refuse_host_reads_and_autograd(lib):
    @replay.replayable
    def host_read(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum())  # .item(): a value baked into the next op

    @replay.replayable
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(host_read(x), x * x.sum())
        w = torch.randn(4, requires_grad=True)
        doubled(w).sum().backward()
        torch.testing.assert_close(w.grad, torch.full((4,), 2.0))
    assert list(replay.stats(host_read)["refused"]) == [
        "aten._local_scalar_dense.default, whose results are not all tensors"
    ]
    # Under autograd only an openkernels op (one autograd function over the arguments) replays.
    assert list(replay.stats(doubled)["refused"]) == [
        "a call under autograd that is not one openkernels autograd function"
    ]


def test_bodies_that_read_tensor_values_on_the_host_are_refused(lib):
    # A scale read with .tolist() escapes the recording: the body says so, and every call
    # keeps computing with the value it is given.
    @replay.replayable
    def scaled(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        replay.reads_host_values("factor")
        y = torch.empty_like(x)
        lib.toy_affine(x.data_ptr(), y.data_ptr(), x.numel(), factor.tolist()[0], 0.0)
        return y

    x = torch.randn(5)
    for value in (1.0, 2.0, 3.0, 4.0):
        torch.testing.assert_close(scaled(x, torch.tensor([value])), x * value)
    assert replay.stats(scaled)["refused"] == {"reads factor on the host": 1}
    replay.reads_host_values("anything")  # outside a recording: nothing happens


def test_kernels_without_a_packed_entry_and_foreign_pointers_are_refused(lib):
    @replay.replayable
    def copy(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        lib.toy_nopack(x.data_ptr(), y.data_ptr(), x.numel())
        return y

    @replay.replayable
    def tail(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.numel() - 1)
        lib.toy_affine(x.data_ptr() + 4, y.data_ptr(), y.numel(), 1.0, 0.0)  # into the middle of x
        return y

    x = torch.randn(6)
    for _ in range(2):
        torch.testing.assert_close(copy(x), x)
        torch.testing.assert_close(tail(x), x[1:])
    assert list(replay.stats(copy)["refused"]) == ["a CPU kernel without a packed entry"]
    assert list(replay.stats(tail)["refused"]) == [
        "a kernel pointer that is neither an input nor an allocation of the call"
    ]


def test_scratch_allocations_are_made_again_and_views_of_results_returned(lib):
    @replay.replayable
    def two_step(x: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(x.numel())
        y = torch.empty(x.numel())
        lib.toy_affine(x.reshape(-1).data_ptr(), scratch.data_ptr(), x.numel(), 2.0, 0.0)
        lib.toy_affine(scratch.data_ptr(), y.data_ptr(), x.numel(), 1.0, 1.0)
        return y.view(x.shape)

    two_step(torch.randn(2, 3))
    two_step(torch.randn(2, 3))
    x = torch.randn(2, 3)
    y = two_step(x)
    torch.testing.assert_close(y, x * 2 + 1)
    assert y.shape == (2, 3) and replay.stats(two_step)["hits"] == 1


def test_autograd_subclasses_steering_compile_and_off_take_the_python_path(lib):
    affine, calls = _affine(lib)
    x = torch.randn(5)
    affine(x)
    affine(x)
    n = len(calls)
    affine(torch.randn(5, requires_grad=True).detach().requires_grad_())  # grad mode on
    affine(torch.nn.Parameter(torch.randn(5), requires_grad=False))  # a Parameter is a plain tensor
    with dispatch.force("reference"):
        affine(x)
    with replay.disabled():
        affine(x)

    class Sub(torch.Tensor):
        pass

    affine(torch.randn(5).as_subclass(Sub))
    assert len(calls) == n + 4
    with torch.no_grad():
        affine(torch.randn(5, requires_grad=True))  # no autograd: replayed
    assert len(calls) == n + 4


def test_strings_are_keyed_by_identity_and_held(lib):
    calls = []

    @replay.replayable
    def tagged(x: torch.Tensor, mode: str) -> torch.Tensor:
        calls.append(mode)
        y = torch.empty_like(x)
        lib.toy_affine(x.data_ptr(), y.data_ptr(), x.numel(), 2.0 if mode == "double" else 1.0, 0.0)
        return y

    x = torch.randn(4)
    for _ in range(3):
        torch.testing.assert_close(tagged(x, "double"), x * 2)
    made = "".join(["sa", "me"])  # a string built at run time: its own key
    torch.testing.assert_close(tagged(x, made), x)
    torch.testing.assert_close(tagged(x, "same"), x)
    assert calls == ["double", "double", made, "same"]


def test_threads_replay_the_same_entries(lib):
    affine, calls = _affine(lib)
    affine(torch.randn(64))
    affine(torch.randn(64))
    errors = []

    def work():
        for _ in range(200):
            x = torch.randn(64)
            if not torch.allclose(affine(x), x * 2.0):
                errors.append(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 2


def test_a_triton_launch_becomes_slots_of_its_parameters():
    """The CUDA launch record (checked here without a GPU): constexprs dropped, pointers
    mapped to inputs and allocations, floats packed as their parameter type."""
    x, y = torch.empty(16), torch.empty(16)
    rec = replay._Recording(cuda=True)
    rec.allocations.append(y)
    compiled = types.SimpleNamespace(
        function=1234,
        metadata=types.SimpleNamespace(
            num_warps=4, num_ctas=1, shared=512, launch_cooperative_grid=False, launch_pdl=False
        ),
        src=types.SimpleNamespace(
            signature={
                "x": "*fp32",
                "y": "*fp32",
                "n": "i32",
                "eps": "fp32",
                "B": "constexpr",
                "none": "*fp32",
            }
        ),
    )
    replay._State.local.recording = rec
    try:
        replay.observe_triton(compiled, (8,), [x, y, -5, 0.5, 64, None])
    finally:
        replay._State.local.recording = None
    rec.triton_launches = 1
    outputs, returns, is_tuple, launches, _ = replay._entry(rec, (x,), {}, y)
    assert returns == [0] and not is_tuple and outputs[0][:3] == (-1, (16,), (1,))
    (launch,) = launches
    assert launch[:8] == (1, 1234, (8, 1, 1), 4, 1, 512, 0, 0)
    half = int.from_bytes(torch.tensor(0.5).numpy().tobytes(), "little")
    assert launch[8] == [(1, 0, 0, 8), (2, 0, 0, 8), (0, 0, -5, 8), (0, 0, half, 4), (0, 0, 0, 8)]


def test_keys_follow_what_the_kernels_specialize_on():
    if not replay.available():
        pytest.skip("the replay extension cannot be built here")
    key = replay._State.module.key
    x = torch.randn(4, 8)
    assert key((x, 1.0), None) == key((torch.randn(4, 8), 1.0), None)
    assert key((x, 1.0), None) != key((x, 1), None)  # int and float differ
    assert key((x, True), None) != key((x, 1), None)
    assert key((x.t(),), None) != key((x,), None)
    assert key((x.half(),), None) != key((x,), None)
    assert key((x, None), None) != key((x,), None)
    assert key((x, (1, 2)), None) != key((x, (1, 3)), None)
    assert key((x, [1]), None) is None  # lists are not keyed
    assert key((x, object()), None) is None


def test_results_no_recorded_launch_wrote_are_refused(lib):
    """A result made where the recording cannot see (here: by numpy) must not be replayed as
    an uninitialized tensor."""

    @replay.replayable
    def filled(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        y.numpy()[:] = 7.0  # no aten op, no observed launch
        return y

    for _ in range(2):
        assert torch.equal(filled(torch.randn(3)), torch.full((3,), 7.0))
    assert list(replay.stats(filled)["refused"]) == ["a result that no recorded launch wrote"]


def test_persistent_tables_are_constants_of_the_launch(lib):
    table = replay.persistent(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # a lookup table kernels read
    calls = []

    @replay.replayable
    def plus_table(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        y = torch.empty(4)
        lib.toy_affine(table.data_ptr(), y.data_ptr(), 4, 1.0, float(x.numel()))
        return y

    for _ in range(4):
        torch.testing.assert_close(plus_table(torch.randn(2)), table + 2)
    assert len(calls) == 2 and replay.stats(plus_table)["hits"] == 2


def test_a_replayable_called_inside_another_ones_recording_runs_its_python(lib):
    """The inner call must not replay from C++ while the outer call records: the outer's
    recording would not see the inner launches."""
    inner, inner_calls = _affine(lib)
    x = torch.randn(8)
    inner(x)
    inner(x)  # the inner key is recorded

    @replay.replayable
    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x)

    for _ in range(4):
        x = torch.randn(8)
        torch.testing.assert_close(outer(x), x * 2.0)
    assert len(inner_calls) == 3  # its two first calls, then once inside outer's recording
    assert replay.stats(outer)["hits"] == 2 and replay.stats(outer)["refused"] == {}


def test_inputs_that_share_memory_are_keyed_apart(lib):
    calls = []

    @replay.replayable
    def second(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        y = torch.empty_like(a)
        lib.toy_affine(b.data_ptr(), y.data_ptr(), b.numel(), 1.0, 0.0)  # y = b
        return y

    x = torch.randn(4)
    for _ in range(2):  # a and b one tensor: seen, recorded
        torch.testing.assert_close(second(x, x), x)
    for _ in range(3):  # must read b, not a: another key (seen, recorded, replayed)
        a, b = torch.randn(4), torch.randn(4)
        torch.testing.assert_close(second(a, b), b)
    x = torch.randn(4)
    torch.testing.assert_close(second(x, x), x)  # replayed: shared again
    assert len(calls) == 4 and replay.stats(second) == {"entries": 2, "hits": 2, "refused": {}, "programs": 0}


def test_one_off_keys_are_never_recorded(lib):
    """A key seen once costs no recording (a prefill of each length); its second call records."""
    affine, calls = _affine(lib)
    for n in range(1, 30):
        affine(torch.randn(n))
    assert replay.stats(affine) == {"entries": 0, "hits": 0, "refused": {}, "programs": 0}
    affine(torch.randn(7))
    assert replay.stats(affine)["entries"] == 1 and len(calls) == 30


def test_threads_replay_one_program_at_once(lib):
    @replay.replayable
    def affine_plus(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        lib.toy_affine(x.data_ptr(), y.data_ptr(), x.numel(), 2.0, 0.0)
        return (y + x).sum(0)

    for _ in range(2):
        affine_plus(torch.randn(8, 16))

    def work() -> None:
        for _ in range(200):
            x = torch.randn(8, 16)
            torch.testing.assert_close(affine_plus(x), (3 * x).sum(0))

    assert run_in_threads(work, 4) == []
    assert replay.entry_kind(affine_plus, torch.randn(8, 16)) == "program"
    assert replay.stats(affine_plus)["hits"] >= 800


def test_tensor_descriptors_become_tensor_map_slots() -> None:
    """A host TMA descriptor argument is recorded as the launcher expands it: a 128-byte map
    slot over the base tensor, with fillTMADescriptor's encoding (innermost dimension first,
    byte strides, the box from the kernel's metadata, the driver's dtype enum), then the
    descriptor's shape as i32 and strides as i64 slots."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    x = torch.zeros(96, 264, dtype=torch.bfloat16)[:, :256]
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    desc = hopper.TensorDescriptor(x, list(x.shape), list(x.stride()), [64, 128], layout)
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 64], "fp4_padded": False}
    slots = replay._tensor_map_slots(desc, meta)
    assert slots[0] == (True, x.data_ptr(), replay.TENSOR_MAP_BYTES, (9, 2, 3, 0, 256, 96, 528, 64, 64))
    assert slots[1:] == [(False, 96, 8), (False, 256, 8), (False, 264, 8), (False, 1, 8)]
    assert "metadata" in replay._tensor_map_slots(desc, None)
    assert "fp4" in replay._tensor_map_slots(desc, {**meta, "fp4_padded": True})


def test_a_tensor_map_slot_names_its_launch_spec() -> None:
    """_build turns a recorded map slot into (input or allocation, spec index, 128) and gives
    the launch its specs as a tenth field; a map over memory the call neither got nor made
    refuses the key."""
    from types import SimpleNamespace

    x, w = torch.zeros(8, 64), torch.zeros(16, 64)
    out = torch.empty(8, 16)
    spec = (9, 2, 3, 0, 64, 8, 128, 64, 8)
    raw = [(True, x.data_ptr(), replay.TENSOR_MAP_BYTES, spec), (False, 8, 8), (False, 64, 8),
           (True, w.data_ptr(), replay.TENSOR_MAP_BYTES, spec), (True, out.data_ptr(), 8)]  # fmt: skip
    # out is passed in (returned as an alias): no allocation, so no dtype code from the extension
    rec = SimpleNamespace(allocations=[], launches=[("cuda", 1234, (1, 1, 1), 4, 1, 0, 0, 0, raw)])
    built = replay._build(rec, [x, w, out], [out])
    assert not isinstance(built, str), built
    (launch,) = built[2]
    assert len(launch) == 10 and launch[9] == [spec, spec]
    assert launch[8][0] == (1, 0, 0, replay.TENSOR_MAP_BYTES) and launch[8][3] == (
        1,
        1,
        1,
        replay.TENSOR_MAP_BYTES,
    )
    assert launch[8][4] == (1, 2, 0, 8)  # the output: input 2
    stray = torch.zeros(4)
    rec.launches = [
        ("cuda", 1234, (1, 1, 1), 4, 1, 0, 0, 0, [(True, stray.data_ptr(), replay.TENSOR_MAP_BYTES, spec)])
    ]
    assert "tensor descriptor" in replay._build(rec, [x, w, out], [out])
