"""One set of overrides for both front ends (issue 26): OPENKERNELS_FORCE / OPENKERNELS_FORBID
and dispatch.force / forbid steer a PyTorch op and the JAX backend choice alike, a bad name
is rejected by both in the same words, and use_backend is a spelling of the same override."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from openkernels.shared import dispatch

jax = pytest.importorskip("jax")
pytest.importorskip("triton")

from openkernels.shared import jax as okjax  # noqa: E402

_counter = itertools.count()
ALL = ("cuda", "rocm", "cpu")
OFF_GPU = pytest.mark.skipif(okjax._on_gpu(), reason="checks the choice off a GPU")


def _torch_op(monkeypatch: pytest.MonkeyPatch) -> str:
    """A throwaway PyTorch op whose implementations return their own names: "fast" on the
    CPU (picked by default), "reference" everywhere. Taken out of dispatch after the test
    (the CLI's tests walk every registered op)."""
    op = f"faces_op_{next(_counter)}"
    monkeypatch.setitem(dispatch._OPS, op, dispatch._Op())
    dispatch.define(op, lambda x: dispatch.key_for(x))
    dispatch.register(op, "fast", lambda x: "fast", backends=("cpu",), priority=10)
    dispatch.register(op, "reference", lambda x: "reference", backends=ALL)
    return op


@OFF_GPU
def test_one_force_steers_a_torch_op_and_the_jax_face(monkeypatch: pytest.MonkeyPatch) -> None:
    op, x = _torch_op(monkeypatch), torch.ones(2)
    assert (dispatch.run(op, x), okjax.backend()) == ("fast", "jnp")
    with dispatch.force("reference"):  # PyTorch's reference, JAX's jnp composition
        assert (dispatch.run(op, x), okjax.backend()) == ("reference", "jnp")
        assert "-> jnp: usable" in okjax.explain()
    with dispatch.force("triton"):
        if okjax._interpreting():  # the Triton kernels run on the interpreter, as PyTorch's do
            assert okjax.backend() == "interpret"
        else:  # forced Triton kernels that cannot run here: an error, not jnp
            with pytest.raises(dispatch.UnsupportedError, match=r"forced \['triton', 'interpret'\]"):
                okjax.backend()
    monkeypatch.setenv("OPENKERNELS_FORCE", "reference")
    assert (dispatch.run(op, x), okjax.backend()) == ("reference", "jnp")
    monkeypatch.setenv("OPENKERNELS_FORCE", "")
    monkeypatch.setenv("OPENKERNELS_FORBID", "reference")
    assert dispatch.run(op, x) == "fast"
    with pytest.raises(dispatch.UnsupportedError, match="jnp: forbidden"):
        okjax.backend()  # nothing else runs JAX ops off a GPU
    assert "nothing can run" in okjax.explain()


@pytest.mark.interpreter
@pytest.mark.skipif(not okjax._interpreting(), reason="needs TRITON_INTERPRET=1")
def test_force_triton_runs_both_faces_on_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TRITON_INTERPRET=1 a forced "triton" runs a PyTorch op's Triton kernel on CPU
    tensors and the JAX ops' Triton launches on the "interpret" backend: the same kernels."""
    activations = pytest.importorskip("openkernels.activations")
    from openkernels.activations import jax as act_jax
    from openkernels.shared.dev.testing.jax import to_jax, to_torch

    launches = []
    real = okjax.launch
    monkeypatch.setattr(okjax, "launch", lambda *a, **k: launches.append(1) or real(*a, **k))
    x = torch.randn(3, 64)
    with dispatch.force("triton"):
        assert okjax.backend() == "interpret"
        assert "runs 'triton'" in dispatch.explain("silu", x).splitlines()[0]
        want = activations.silu(x)
        got = to_torch(act_jax.silu(to_jax(x)))
    assert launches, "the JAX op did not launch the Triton kernel"
    torch.testing.assert_close(got, want)
    assert okjax.backend() == "jnp"  # and only inside the block


def test_a_bad_name_is_rejected_by_both_faces(monkeypatch: pytest.MonkeyPatch) -> None:
    op, x = _torch_op(monkeypatch), torch.ones(2)
    with pytest.raises(dispatch.UnsupportedError, match="unknown implementation 'refrence'"):
        dispatch.force("refrence")
    with pytest.raises(dispatch.UnsupportedError, match="jax has no implementation named 'refrence'"):
        dispatch.force("jax:refrence")  # checked when the block is made, like a bare name
    with pytest.raises(dispatch.UnsupportedError, match="jax has no implementation named 'refrence'"):
        okjax.use_backend("refrence").__enter__()
    monkeypatch.setenv("OPENKERNELS_FORCE", "refrence")
    for call in (lambda: dispatch.run(op, x), okjax.backend):
        with pytest.raises(dispatch.UnsupportedError, match="OPENKERNELS_FORCE='refrence' names unknown"):
            call()


@OFF_GPU
def test_names_of_one_face_leave_the_other_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    op, x = _torch_op(monkeypatch), torch.ones(2)
    for only_jax in ("jnp", "jax:jnp", "jax:reference"):
        with dispatch.force(only_jax):
            assert dispatch.run(op, x) == "fast"
            assert not dispatch.is_steered() and dispatch.unsteered()  # replay and hf.py's SDPA route stay
            assert okjax.backend() == "jnp"
    with dispatch.force("fast", f"{op}:reference"):  # names JAX has not: its default
        assert okjax.backend() == "jnp"
        assert dispatch.is_steered() and not dispatch.unsteered()
    monkeypatch.setenv("OPENKERNELS_FORCE", "jax:jnp")
    assert dispatch.unsteered() and dispatch.run(op, x) == "fast"


def test_use_backend_is_the_shared_override_and_the_innermost_wins() -> None:
    with dispatch.force("reference"), okjax.use_backend("jnp"):
        assert dispatch.snapshot().forced == ("jax:jnp", "reference")
    if okjax.unavailable("triton") is None:
        pytest.skip("every backend runs here")
    # An enclosing force of a backend that cannot run here: use_backend's own wins, as a
    # JAX backward re-entering its forward's backend must.
    with dispatch.force("jax:triton"), okjax.use_backend("jnp"):
        assert okjax.backend() == "jnp"
    with okjax.use_backend("reference"):  # the name both faces know
        assert okjax.backend() == "jnp"


def test_jax_names_are_known_in_a_process_without_jax() -> None:
    code = (
        "import sys, torch\n"
        "from openkernels.shared import dispatch\n"
        "dispatch.define('probe', lambda x: dispatch.key_for(x))\n"
        "dispatch.register('probe', 'reference', lambda x: 'ran', backends=('cpu',))\n"
        "with dispatch.force('jnp', 'interpret', 'jax:triton'):\n"
        "    print(dispatch.run('probe', torch.ones(2)))\n"
        "print('jax' in sys.modules)\n"
    )
    env = {**os.environ, "OPENKERNELS_FORCE": "jnp,reference"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ran", "False"]
