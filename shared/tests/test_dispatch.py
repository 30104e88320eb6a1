"""Dispatch: selection by priority and predicate, forcing, forbidding, explain, fallback."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch

from openkernels.shared import dispatch

_counter = itertools.count()


def _fresh_op(*impls: tuple[str, tuple[str, ...], int, object]) -> tuple[str, list[str]]:
    """Register a throwaway op whose implementations record their name when called."""
    op = f"test_op_{next(_counter)}"
    calls: list[str] = []
    dispatch.define(op, lambda x: dispatch.key_for(x))
    for name, backends, priority, behaviour in impls:

        def fn(x: torch.Tensor, _name: str = name, _behaviour: object = behaviour) -> str:
            if isinstance(_behaviour, Exception):
                raise _behaviour
            calls.append(_name)
            return _name

        supports = behaviour if callable(behaviour) and not isinstance(behaviour, Exception) else None
        dispatch.register(op, name, fn, backends=backends, priority=priority, supports=supports)
    return op, calls


ALL = ("cuda", "rocm", "cpu")


def test_highest_priority_usable_implementation_runs() -> None:
    op, _ = _fresh_op(("gpu", ("cuda",), 20, None), ("fast", ("cpu",), 10, None), ("reference", ALL, 0, None))
    assert dispatch.run(op, torch.ones(2)) == "fast"


def test_predicate_rejection_moves_to_next() -> None:
    no_f16 = lambda key: "no float16" if key.dtype == torch.float16 else None  # noqa: E731
    op, _ = _fresh_op(("fast", ("cpu",), 10, no_f16), ("reference", ALL, 0, None))
    assert dispatch.run(op, torch.ones(2)) == "fast"
    assert dispatch.run(op, torch.ones(2, dtype=torch.float16)) == "reference"
    assert "no float16" in dispatch.explain(op, torch.ones(2, dtype=torch.float16))


def test_force_and_forbid_context_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    op, _ = _fresh_op(("fast", ("cpu",), 10, None), ("reference", ALL, 0, None))
    x = torch.ones(2)
    with dispatch.force("reference"):
        assert dispatch.run(op, x) == "reference"
    with dispatch.forbid(f"{op}:fast"):
        assert dispatch.run(op, x) == "reference"
    monkeypatch.setenv("OPENKERNELS_FORCE", f"{op}:reference")
    assert dispatch.run(op, x) == "reference"
    monkeypatch.delenv("OPENKERNELS_FORCE")
    monkeypatch.setenv("OPENKERNELS_FORBID", "fast")
    assert dispatch.run(op, x) == "reference"
    monkeypatch.delenv("OPENKERNELS_FORBID")
    assert dispatch.run(op, x) == "fast"


def test_forced_names_follow_blocks_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    op, _ = _fresh_op(("fast", ("cpu",), 10, None), ("reference", ALL, 0, None))
    assert dispatch.forced_names(op) == frozenset()
    with dispatch.force(f"{op}:fast"):
        assert dispatch.forced_names(op) == {"fast"}
        with dispatch.force("reference"):
            assert dispatch.forced_names(op) == {"fast", "reference"}
    assert dispatch.forced_names(op) == frozenset()  # cached per steering state, not stale
    monkeypatch.setenv("OPENKERNELS_FORCE", f"{op}:reference")
    assert dispatch.forced_names(op) == {"reference"}
    monkeypatch.delenv("OPENKERNELS_FORCE")
    assert dispatch.forced_names(op) == frozenset()


def test_forcing_an_unusable_implementation_is_a_clear_error() -> None:
    op, _ = _fresh_op(("gpu", ("cuda",), 20, None), ("reference", ALL, 0, None))
    with dispatch.force("gpu"), pytest.raises(dispatch.UnsupportedError, match="runs on cuda, not cpu"):
        dispatch.run(op, torch.ones(2))
    with (
        dispatch.force(f"{op}:nonexistent"),
        pytest.raises(dispatch.UnsupportedError, match="no implementation"),
    ):
        dispatch.run(op, torch.ones(2))


def test_global_force_skips_ops_without_that_implementation() -> None:
    op, _ = _fresh_op(("reference", ALL, 0, None))
    with dispatch.force("triton"):
        assert dispatch.run(op, torch.ones(2)) == "reference"


def test_nothing_usable_names_every_reason() -> None:
    op, _ = _fresh_op(("gpu", ("cuda",), 20, None))
    with pytest.raises(dispatch.UnsupportedError, match="gpu: runs on cuda, not cpu"):
        dispatch.run(op, torch.ones(2))


def test_failure_falls_back_once_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    op, calls = _fresh_op(("fast", ("cpu",), 10, RuntimeError("ptxas died")), ("reference", ALL, 0, None))
    with pytest.warns(dispatch.KernelFallbackWarning, match="ptxas died"):
        assert dispatch.run(op, torch.ones(2)) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.run(op, torch.ones(2)) == "reference"
    assert calls == ["reference", "reference"]
    explained = dispatch.explain(op, torch.ones(2))
    assert "failed earlier" in explained
    assert "runs 'reference'" in explained.splitlines()[0]  # what runs now, not the failed one
    assert any(line.startswith(" -> reference") for line in explained.splitlines())
    dispatch.reset_failures()


def test_failure_raises_when_strict_or_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    op, _ = _fresh_op(("fast", ("cpu",), 10, RuntimeError("boom")), ("reference", ALL, 0, None))
    monkeypatch.setenv("OPENKERNELS_STRICT", "1")
    with pytest.raises(RuntimeError, match="boom"):
        dispatch.run(op, torch.ones(2))
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    with dispatch.force("fast"), pytest.raises(RuntimeError, match="boom"):
        dispatch.run(op, torch.ones(2))
    with dispatch.strict(), pytest.raises(RuntimeError, match="boom"):
        dispatch.run(op, torch.ones(2))


def test_invalid_input_propagates_and_marks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel's own input check (InvalidInputError) is the caller's error: no fallback onto
    the same bad inputs, and the kernel keeps running later calls (a length past a KV cache
    once sent every later CPU decode of that key to the reference)."""
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    bad = dispatch.InvalidInputError("length past the cache")
    op, calls = _fresh_op(("fast", ("cpu",), 10, lambda key: None), ("reference", ALL, 0, None))
    impl = next(i for i in dispatch._op(op).impls if i.name == "fast")
    good = impl.fn
    state = {"bad": True}

    def fast(x: torch.Tensor) -> str:
        if state["bad"]:
            raise bad
        return good(x)

    dispatch._op(op).impls[dispatch._op(op).impls.index(impl)] = dataclasses.replace(impl, fn=fast)
    dispatch.changed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no KernelFallbackWarning
        with pytest.raises(ValueError, match="past the cache"):
            dispatch.run(op, torch.ones(2))
        state["bad"] = False
        assert dispatch.run(op, torch.ones(2)) == "fast"
    assert calls == ["fast"] and "failed earlier" not in dispatch.explain(op, torch.ones(2))


def test_out_of_memory_is_never_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    op, _ = _fresh_op(("fast", ("cpu",), 10, torch.OutOfMemoryError("oom")), ("reference", ALL, 0, None))
    with pytest.raises(torch.OutOfMemoryError):
        dispatch.run(op, torch.ones(2))


def test_broken_predicate_disqualifies_only_its_implementation() -> None:
    def broken(key: dispatch.DispatchKey) -> str | None:
        raise ImportError("missing module")

    op, _ = _fresh_op(("fast", ("cpu",), 10, broken), ("reference", ALL, 0, None))
    assert dispatch.run(op, torch.ones(2)) == "reference"
    assert "predicate failed: ImportError: missing module" in dispatch.explain(op, torch.ones(2))


def test_selection_is_cached_per_key() -> None:
    seen = []

    def counting(key: dispatch.DispatchKey) -> None:
        seen.append(key)

    op, _ = _fresh_op(("fast", ("cpu",), 10, counting))
    for _ in range(5):
        dispatch.run(op, torch.ones(3))
    dispatch.run(op, torch.ones(3, dtype=torch.float64))
    assert len(seen) == 2


def test_duplicate_and_unknown_names_are_errors() -> None:
    op, _ = _fresh_op(("reference", ALL, 0, None))
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register(op, "reference", print, backends=ALL)
    with pytest.raises(dispatch.UnsupportedError, match="unknown op"):
        dispatch.run("no_such_op", torch.ones(1))


def test_lazy_imports_on_first_call() -> None:
    fn = dispatch.lazy("math:fsum")
    assert fn([0.1] * 10) == 1.0
    assert "math:fsum" in repr(fn)


def test_triton_predicate_on_cpu() -> None:
    from openkernels.shared.platform import triton_available, triton_interpreting

    key = dispatch.DispatchKey("cpu", "avx2", torch.float32)
    if triton_available() and not triton_interpreting():
        assert "CUDA or ROCm" in (dispatch.triton_supports(key) or "")
    elif triton_interpreting():
        assert dispatch.triton_supports(key) is None


def test_snapshot_carries_force_to_another_thread() -> None:
    """Autograd runs CUDA backwards on its own threads: a backward run in the forward's
    snapshot sees the forward's force block; one run without it does not."""
    import threading

    op, _ = _fresh_op(("fast", ("cpu",), 10, None), ("reference", ALL, 0, None))
    x = torch.ones(2)
    with dispatch.force("reference"):
        saved = dispatch.snapshot()
    results: dict[str, str] = {}

    def worker() -> None:
        results["plain"] = dispatch.run(op, x)
        results["snapshot"] = saved.run(dispatch.run, op, x)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert results == {"plain": "fast", "snapshot": "reference"}


def test_force_first_tries_the_inner_block_first() -> None:
    op, _ = _fresh_op(("fast", ("cpu",), 10, None), ("reference", ALL, 0, None))
    x = torch.ones(2)
    with dispatch.force("reference"), dispatch.force(f"{op}:fast"):
        assert dispatch.run(op, x) == "reference"  # force: the enclosing block's entries first
    with dispatch.force("reference"), dispatch.force_first(f"{op}:fast"):
        assert dispatch.run(op, x) == "fast"
        assert dispatch.steering(op) == (["fast", "reference"], [])
    with dispatch.forbid("fast"):
        assert dispatch.steering(op) == ([], ["fast"])


def test_the_jax_face_answers_the_shared_names() -> None:
    """The JAX backends are declared in dispatch (no JAX imported for that): "reference"
    selects "jnp", "triton" the Triton kernels by jax-triton or the interpreter."""
    assert dispatch.selected_by(dispatch.JAX, "triton") == ["triton", "interpret"]
    assert dispatch.selected_by(dispatch.JAX, "reference") == ["jnp"]
    assert dispatch.selected_by(dispatch.JAX, "jax:interpret") == ["interpret"]
    assert dispatch.selected_by(dispatch.JAX, "cpu") == []  # a name of the PyTorch face only
    with pytest.raises(dispatch.UnsupportedError, match="jax has no implementation named 'cpu'"):
        dispatch.selected_by(dispatch.JAX, "jax:cpu")
    assert dispatch.JAX not in dispatch._OPS  # the registry of PyTorch ops stays theirs
    interpret = next(i for i in dispatch.implementations(dispatch.JAX) if i.name == "interpret")
    key = dispatch.DispatchKey(dispatch.JAX, "cpu", None, frozenset({"interpreter"}))
    assert str(key) == "jax/cpu [interpreter]"
    assert interpret.rejection(key) == "runs only when forced"


def test_explain_shows_where_a_routing_launcher_sends_the_call() -> None:
    """A launcher that sends some calls elsewhere (quant's "gemv" hands M > 8 on; "wgmma" sends
    shapes it measured slower to Triton) says so through its `route` attribute; a route that
    raises does not fail explain."""
    op = f"test_op_{next(_counter)}"
    dispatch.define(op, lambda x: dispatch.key_for(x))

    def launcher(x: torch.Tensor) -> str:
        return "launcher"

    launcher.route = lambda x: None if x.numel() < 4 else f"handed on ({x.numel()} elements)"  # type: ignore[attr-defined]
    dispatch.register(op, "launcher", launcher, backends=ALL, priority=10)
    assert "for these arguments" not in dispatch.explain(op, torch.ones(2))
    assert "runs 'launcher'; for these arguments: handed on (8 elements)" in dispatch.explain(
        op, torch.ones(8)
    )
    launcher.route = lambda x: 1 / 0  # type: ignore[attr-defined]
    assert "route could not be read: ZeroDivisionError" in dispatch.explain(op, torch.ones(8))
    assert dispatch.run(op, torch.ones(8)) == "launcher"
