"""Which implementations a test can exercise here, and torch.library.opcheck wrappers."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ... import dispatch, replay
from ...dispatch import implementations
from ...platform import device_info, triton_interpreting

__all__ = ["testable_implementations", "targets", "run_opcheck", "failing_implementation"]


def testable_implementations(op: str, device: torch.device | str = "cpu") -> list[str]:
    """Names of the implementations of `op` that can run on `device` in this process.

    Under TRITON_INTERPRET=1 only Triton kernels are returned (they run on CPU tensors);
    otherwise every implementation whose backend matches the device, the reference included.
    """
    backend = device_info(device).backend
    names = []
    for impl in implementations(op):
        if triton_interpreting():
            if impl.interpretable:
                names.append(impl.name)
        elif backend in impl.backends:
            names.append(impl.name)
    return names


def targets(op: str, *, skip: Sequence[str] = ()) -> list[Any]:
    """pytest params (device, implementation) of `op` testable in this process, with marks:
    `interpreter` under TRITON_INTERPRET=1, `gpu` off the CPU; ids "<device>-<impl>". The CPU
    always, CUDA when there is one; `skip`: implementations a test file covers elsewhere."""
    import pytest  # a test-time dependency: only the tests call this

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    params = []
    for device in devices:
        for impl in testable_implementations(op, device):
            if impl in skip:
                continue
            marks = [pytest.mark.interpreter] if triton_interpreting() else []
            if device != "cpu":
                marks.append(pytest.mark.gpu)
            params.append(pytest.param(device, impl, id=f"{device}-{impl}", marks=marks))
    return params


# Backward checks on ops whose backward is another library op; the rest compare schemas,
# fakes and dispatch. "test_aot_dispatch_dynamic" takes minutes on CPU, so it is opt-in.
DEFAULT_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")


def run_opcheck(
    op: torch._ops.OpOverload | Any,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    test_utils: Sequence[str] = DEFAULT_UTILS,
) -> None:
    """torch.library.opcheck that raises with the failing check named."""
    result = torch.library.opcheck(
        op, tuple(args), kwargs or {}, test_utils=tuple(test_utils), raise_exception=True
    )
    failed = {k: v for k, v in result.items() if v != "SUCCESS"}
    if failed:
        raise AssertionError(f"opcheck failed for {op}: {failed}")


@contextlib.contextmanager
def failing_implementation(op: str, name: str, error: Exception) -> Iterator[None]:
    """Inside the block implementation `name` of `op` raises `error` when called, as a
    kernel that fails to compile or launch would; the registry is restored afterwards."""
    impls = dispatch._op(op).impls
    index = next(i for i, impl in enumerate(impls) if impl.name == name)
    original = impls[index]

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    impls[index] = dataclasses.replace(original, fn=fail)
    dispatch.changed()
    try:
        with replay.disabled():  # a call recorded before the block would replay the real kernel
            yield
    finally:
        impls[index] = original
        dispatch.changed()
        dispatch.reset_failures()
