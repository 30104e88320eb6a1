"""Reliability of steering and of the kernelize import (issue 20, items 10 and 12): a typo
in force / forbid / OPENKERNELS_FORCE / OPENKERNELS_FORBID raises instead of quietly
turning steering off, force / forbid blocks stay in their own thread, and
`from openkernels.shared import kernelize` gives something callable."""

from __future__ import annotations

import inspect
import itertools
import subprocess
import sys
import threading

import pytest
import torch

from openkernels.shared import dispatch
from openkernels.shared.dev.testing.threads import run_in_threads

_counter = itertools.count()
ALL = ("cuda", "rocm", "cpu")


_MADE: list[str] = []  # throwaway ops, taken out of dispatch after each test


@pytest.fixture(autouse=True)
def _forget_throwaway_ops():
    """Tests that walk every registered op (the CLI's env) must not meet these."""
    yield
    while _MADE:
        dispatch._OPS.pop(_MADE.pop(), None)
    dispatch.changed()


def _name() -> str:
    """A fresh throwaway op name, forgotten by dispatch after the test."""
    op = f"steer_op_{next(_counter)}"
    _MADE.append(op)
    return op


def _op(*names: str) -> str:
    """A throwaway op on every backend whose implementations return their own name, the
    first name with the highest priority."""
    op = _name()
    dispatch.define(op, lambda x: dispatch.key_for(x))
    for priority, name in enumerate(reversed(names)):
        dispatch.register(op, name, lambda x, _name=name: _name, backends=ALL, priority=priority)
    return op


@pytest.fixture(autouse=True)
def _families_already_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown name first imports every installed family (a name may be one of theirs);
    skip that here, where the names are throwaway ops' (one test checks the import)."""
    monkeypatch.setattr(dispatch, "_families_imported", True, raising=False)


# ---- item 10: unknown names raise, naming the known ones -------------------------------


@pytest.mark.parametrize("manager", [dispatch.force, dispatch.forbid])
def test_unknown_implementation_name_raises_when_the_block_is_made(manager) -> None:
    _op("fast", "reference")
    with pytest.raises(ValueError, match=r"unknown implementation 'refrence' \(known: .*reference.*triton"):
        manager("refrence")
    with pytest.raises(TypeError, match="entries are strings"):
        manager(["reference"])


@pytest.mark.parametrize("manager", [dispatch.force, dispatch.forbid])
def test_unknown_op_name_raises_at_the_first_dispatch_of_any_op(manager) -> None:
    op = _op("fast", "reference")
    x = torch.ones(2)
    # Entering is fine (the op's family may be imported inside the block); the first
    # dispatch of any op says what is wrong, with the registered ops listed.
    with manager("silu_and_mull:reference"), pytest.raises(dispatch.UnsupportedError) as error:
        dispatch.run(op, x)
    assert "unknown op 'silu_and_mull'" in str(error.value)
    assert op in str(error.value)
    other = _op("fast", "reference")  # a real op, a name it lacks: before, ignored by `op`
    with (
        manager(f"{other}:refrence"),
        pytest.raises(ValueError, match=f"but {other} has no implementation named 'refrence'"),
    ):
        dispatch.run(op, x)
    with manager(f"{other}:refrence"), pytest.raises(ValueError, match="no implementation named"):
        dispatch.explain(op, x)
    assert dispatch.run(op, x) == "fast"  # nothing left behind


@pytest.mark.parametrize("env", ["OPENKERNELS_FORCE", "OPENKERNELS_FORBID"])
@pytest.mark.parametrize("value", ["refrence", "silu_and_mull:reference", "reference,cpu,tritn"])
def test_unknown_names_in_the_environment_raise_on_every_call(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str
) -> None:
    op = _op("fast", "reference")
    x = torch.ones(2)
    assert dispatch.run(op, x) == "fast"  # a cached selection must not hide the new value
    monkeypatch.setenv(env, value)
    for _ in range(2):  # a failed check is not cached
        with pytest.raises(ValueError, match=f"{env}={value!r} names unknown"):
            dispatch.run(op, x)
    with pytest.raises(ValueError, match=r"\(known( ops)?: "):
        dispatch.explain(op, x)
    monkeypatch.delenv(env)
    assert dispatch.run(op, x) == "fast"


def test_valid_names_keep_working(monkeypatch: pytest.MonkeyPatch) -> None:
    op = _op("fast", "reference")
    x = torch.ones(2)
    # The standard names are known with no family imported; a bare one applies only to ops
    # that have it.
    with dispatch.force("triton", "reference"):
        assert dispatch.run(op, x) == "reference"
    with dispatch.forbid("cpu"), dispatch.force(f"{op}:fast"):
        assert dispatch.run(op, x) == "fast"
    monkeypatch.setenv("OPENKERNELS_FORCE", f" {op}:reference , triton ")
    assert dispatch.run(op, x) == "reference"
    monkeypatch.setenv("OPENKERNELS_FORCE", "")
    assert dispatch.run(op, x) == "fast"


def test_op_defined_inside_the_block_is_accepted() -> None:
    later = _name()
    with dispatch.force(f"{later}:reference"):  # as a family imported inside the block
        op = _op("fast", "reference")
        dispatch.define(later, lambda x: dispatch.key_for(x))
        dispatch.register(later, "reference", lambda x: "late reference", backends=ALL)
        assert dispatch.run(later, torch.ones(2)) == "late reference"
        assert dispatch.run(op, torch.ones(2)) == "fast"


def test_unknown_name_first_imports_the_installed_families(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name registered by a family the process has not imported yet is valid: the check
    imports the families (here a stand-in registering one op) and looks again."""
    late = _name()
    imported = []

    def import_families() -> None:
        imported.append(True)
        dispatch.define(late, lambda x: dispatch.key_for(x))
        dispatch.register(late, "late_impl", lambda x: "late", backends=ALL)

    monkeypatch.setattr(dispatch, "_import_families", import_families)
    with dispatch.force("late_impl"):
        assert dispatch.run(late, torch.ones(2)) == "late"
    assert imported == [True]


def test_real_family_names_from_a_process_that_imported_no_family() -> None:
    """One process, the families imported by the check: a layernorm op name is valid, an
    activations op name with a typo is not, and the error lists the real ops."""
    pytest.importorskip("openkernels.layernorm")
    pytest.importorskip("openkernels.activations")
    code = (
        "import sys, torch\n"
        "from openkernels.shared import dispatch\n"
        "dispatch.define('probe', lambda x: dispatch.key_for(x))\n"
        "dispatch.register('probe', 'reference', lambda x: 'ran', backends=('cpu',))\n"
        "assert 'openkernels.layernorm' not in sys.modules\n"
        "with dispatch.force('rms_norm:reference'):\n"
        "    assert dispatch.run('probe', torch.ones(2)) == 'ran'\n"
        "assert 'openkernels.layernorm' in sys.modules\n"
        "try:\n"
        "    with dispatch.force('silu_and_mull:reference'):\n"
        "        dispatch.run('probe', torch.ones(2))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "unknown op 'silu_and_mull'" in result.stdout
    assert "silu_and_mul," in result.stdout


# ---- force / forbid blocks are per thread ----------------------------------------------


def test_threads_see_only_their_own_force_and_forbid_blocks() -> None:
    op = _op("fast", "cpu", "reference")
    x = torch.ones(2)
    blocks = {
        "force reference": lambda: dispatch.force("reference"),
        "force cpu": lambda: dispatch.force(f"{op}:cpu"),
        "forbid fast": lambda: dispatch.forbid("fast"),
        "none": None,
    }
    expected = {"force reference": "reference", "force cpu": "cpu", "forbid fast": "cpu", "none": "fast"}
    inside = threading.Barrier(len(blocks), timeout=30)
    seen: dict[str, set[str]] = {}
    errors: list[BaseException] = []

    def worker(label: str) -> None:
        try:
            make = blocks[label]
            runs = set()
            if make is None:
                inside.wait()  # every other thread is inside its block now
                runs.update(dispatch.run(op, x) for _ in range(50))
                inside.wait()
            else:
                with make():
                    inside.wait()
                    runs.update(dispatch.run(op, x) for _ in range(50))
                    inside.wait()  # nobody leaves before all have run
            runs.add(dispatch.run(op, x) + " after")
            seen[label] = runs
        except BaseException as error:
            errors.append(error)
            inside.abort()

    threads = [threading.Thread(target=worker, args=(label,)) for label in blocks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert seen == {label: {expected[label], "fast after"} for label in blocks}
    assert dispatch.run(op, x) == "fast"  # and the main thread saw none of them


# ---- item 12: `from openkernels.shared import kernelize` is callable -------------------


def test_kernelize_imported_from_the_package_is_callable() -> None:
    from openkernels.shared import kernelize

    model = torch.nn.Sequential(torch.nn.RMSNorm(8))
    report = kernelize(model, families=[])  # before: TypeError: 'module' object is not callable
    assert type(report).__name__ == "KernelizeReport"
    from openkernels.shared import unkernelize

    assert unkernelize(model) is report

    # What existing code does keeps working: it is the module, with every helper on it.
    import openkernels.shared
    import openkernels.shared.kernelize as module
    from openkernels.shared.kernelize import Swap
    from openkernels.shared.kernelize import kernelize as function

    assert kernelize is module is openkernels.shared.kernelize
    assert module.Swap is Swap and module.kernelize is function and callable(module.available_swaps)
    assert next(iter(inspect.signature(kernelize).parameters)) == "model"
    with pytest.raises(AttributeError, match="no_such_thing"):
        openkernels.shared.no_such_thing  # noqa: B018


def test_importing_the_package_stays_light() -> None:
    code = (
        "import sys\n"
        "import openkernels.shared\n"
        "assert 'torch' not in sys.modules and 'openkernels.shared.kernelize' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---- a snapshot serves any number of threads at once ---------------------------------


def test_one_snapshot_runs_in_two_threads_at_once() -> None:
    """Autograd may run one graph's backward in two threads (retain_graph=True); each runs
    the saved snapshot. A contextvars.Context refused the second ("cannot enter context")."""
    op = _op("fast", "cpu", "reference")
    x = torch.ones(2)
    with dispatch.force("reference"):
        steering = dispatch.snapshot()
    both_inside = threading.Barrier(2, timeout=30)
    seen: list[str] = []
    errors: list[BaseException] = []

    def body() -> None:
        both_inside.wait()  # the other thread is inside its run too
        seen.append(dispatch.run(op, x))

    def worker() -> None:
        try:
            steering.run(body)
        except BaseException as error:
            errors.append(error)
            both_inside.abort()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert seen == ["reference", "reference"]
    assert dispatch.run(op, x) == "fast"  # run() put the thread's own state back


def _family_graphs() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, leaf, loss) of one eager call per family with a backward."""
    from openkernels import activations, attention, layernorm, quant

    torch.manual_seed(0)
    graphs = []
    x = torch.randn(64, 256, requires_grad=True)
    graphs.append(("rms_norm", x, layernorm.rms_norm(x, torch.ones(256)).square().sum()))
    x = torch.randn(64, 512, requires_grad=True)
    graphs.append(("silu_and_mul", x, activations.silu_and_mul(x).square().sum()))
    q = torch.randn(1, 64, 2, 32, requires_grad=True)
    kv = torch.randn(1, 64, 2, 32)
    graphs.append(("attention", q, attention.attention(q, kv, kv, causal=True).square().sum()))
    w = quant.quantize_int4(torch.randn(128, 256) * 0.02, 128)
    x = torch.randn(4, 256, requires_grad=True)
    graphs.append(("int4_linear", x, quant.int4_linear(x, w).square().sum()))
    return graphs


def test_backward_of_one_graph_in_many_threads_every_family() -> None:
    """torch.autograd.grad(..., retain_graph=True) on one graph from 8 threads at once, as
    torch's own ops allow: the same gradients, no "cannot enter context" error."""
    for name, leaf, loss in _family_graphs():
        (want,) = torch.autograd.grad(loss, leaf, retain_graph=True)
        grads: list[torch.Tensor] = []

        def worker(loss=loss, leaf=leaf, grads=grads) -> None:
            for _ in range(5):
                grads.append(torch.autograd.grad(loss, leaf, retain_graph=True)[0])

        errors = run_in_threads(worker, 8)
        assert not errors, f"{name}: {errors[0]!r}"
        assert len(grads) == 40 and all(torch.equal(g, want) for g in grads), name
