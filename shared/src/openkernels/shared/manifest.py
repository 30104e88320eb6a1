"""Family manifests: what each installed openkernels family offers, declared by the family.

A family (`openkernels.<name>`, distribution `openkernels-<name>`) declares one
`FamilyManifest` in `openkernels/<name>/manifest.py` and names it in the entry-point group
`openkernels.families` of its pyproject:

    [project.entry-points."openkernels.families"]
    attention = "openkernels.attention.manifest:MANIFEST"

The CLI (`bench`, `check`), `kernelize` and dispatch's import of the families read the
manifests instead of guessing from module names. A source checkout put on PYTHONPATH has no
entry points: its `openkernels.<name>.manifest` modules are found on the namespace path.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
from dataclasses import dataclass
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "FamilyManifest", "families", "resolve"]

ENTRY_POINT_GROUP = "openkernels.families"


@dataclass(frozen=True)
class FamilyManifest:
    """One family's offer.

    name: the `openkernels.<name>` package; distribution: its pip name.
    bench: modules of the package with `checks()` / `cases()` for the CLI, in order
        ("bench" first: its cases are the family's headline benchmark).
    kernelize: "module:function" returning the family's `Swap` / `ModelPatch` list, or None.
    asv_suite: the module of benchmarks/asv_suite that times this family, or None.
    """

    name: str
    distribution: str
    bench: tuple[str, ...] = ("bench",)
    kernelize: str | None = None
    asv_suite: str | None = None

    @classmethod
    def standard(cls, name: str, bench: tuple[str, ...] = ("bench",)) -> FamilyManifest:
        """A family of this repository: distribution openkernels-<name>, kernelize in
        openkernels.<name>.kernelize, asv suite benchmarks/asv_suite/<name>.py."""
        return cls(name, f"openkernels-{name}", bench, f"openkernels.{name}.kernelize:replacements", name)

    def bench_modules(self) -> list[Any]:
        """The bench modules that import here (a module needing a missing extra is left out)."""
        modules = []
        for module in self.bench:
            try:
                modules.append(importlib.import_module(f"openkernels.{self.name}.{module}"))
            except ImportError:
                continue
        return modules


def resolve(target: str) -> Any:
    """The object "package.module:attribute" names."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def families() -> dict[str, FamilyManifest]:
    """Installed families by name, sorted: entry points first, then manifests found on the
    namespace path (source checkouts). A manifest that fails to import is left out (a
    family broken by its own import says so when imported)."""
    found: dict[str, FamilyManifest] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            manifest = ep.load()
        except ImportError:  # an entry point left behind by an uninstalled family
            continue
        found[manifest.name] = manifest
    import openkernels

    for module in pkgutil.iter_modules(openkernels.__path__):
        name = module.name
        if name == "shared" or name in found:
            continue
        try:
            if importlib.util.find_spec(f"openkernels.{name}.manifest") is None:
                continue
            found[name] = importlib.import_module(f"openkernels.{name}.manifest").MANIFEST
        except (ImportError, AttributeError):
            continue
    return dict(sorted(found.items()))
