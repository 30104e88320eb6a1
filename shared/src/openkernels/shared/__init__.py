"""openkernels.shared: dispatch, platform detection, testing and benchmark helpers.

`from openkernels.shared import kernelize` gives the kernelize module, and the module is
callable: `kernelize(model, ...)` runs `kernelize.kernelize(model, ...)`, the habit of HF
kernels' `from kernels import kernelize`. `import openkernels.shared.kernelize`,
`from openkernels.shared.kernelize import Swap` and `kernelize.unkernelize` work as
always. `from openkernels.shared import unkernelize` gives the function.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.16.17"


class _CallableModule(types.ModuleType):
    """A module whose call runs its function of the same name (`kernelize` of kernelize.py).

    A module and not the function, so its helpers and mock.patch targets stay reachable
    as attributes of `openkernels.shared.kernelize`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)

    @property
    def __signature__(self) -> Any:  # inspect.signature / help() show the function's
        import inspect

        return inspect.signature(getattr(self, self.__name__.rpartition(".")[2]))


def _make_callable(name: str) -> None:
    """Make the (already executing) module `name` callable; kernelize.py calls it at its end."""
    sys.modules[name].__class__ = _CallableModule


def __getattr__(name: str) -> Any:
    # `openkernels.shared.kernelize(model)` with the submodule not imported yet; lazy, so
    # `import openkernels.shared` imports no torch.
    if name in ("kernelize", "unkernelize"):
        module = importlib.import_module(f"{__name__}.kernelize")
        return module if name == "kernelize" else module.unkernelize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
