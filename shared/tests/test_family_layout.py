"""Every family has the inner layout docs/adding-a-kernel.md writes down ("The layout of a
family"): the same module names for the same jobs, so that one family read teaches all four.

A module at a place the layout does not name fails here; add it to the layout (and its doc)
or move it. Sub-packages (one per problem, attention) follow the same inner layout."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())

# Every problem's package has these; the rest of ROLES only where the family has something for it.
REQUIRED = {
    "api.py",
    "ops.py",
    "reference.py",
    "triton/__init__.py",
    "triton/kernels.py",
    "cpu/__init__.py",
    "jax/__init__.py",
}
ROLES = REQUIRED | {
    "__init__.py",
    "problem.py",
    "triton/plan.py",
    "triton/configs.py",
    "jax/launch.py",
    "jax/jnp.py",
    "bench.py",
    "bench/*",
    "cpu/*",
    "cuda/*",
    "gluon/*",
    "kernelize.py",
    "kernelize/*",
    "manifest.py",
}
# Data modules every backend of one family shares (docs/adding-a-kernel.md names each).
# A family mid-move to the layout: name -> why (its tests are then expected failures).
UNFINISHED: dict[str, str] = {}


def _families() -> list:
    return [
        pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=UNFINISHED[f])) if f in UNFINISHED else f
        for f in FAMILIES
    ]


FAMILY_DATA = {
    "activations": {"spec.py"},
    "quant": {
        "format.py",
        "quantize.py",
        "checkpoints.py",
        "linear.py",
        "fused.py",
        "jax/format.py",
        "jax/quantize.py",
    },
    "attention": {"core/cudnn.py", "core/adopt.py", "kvcache/format.py", "kvcache/cache.py", "kvcache/hf.py"},
}
# A family root that splits into problems keeps only these beside its sub-packages.
# hf.py: the transformers attention function, which calls more than one problem.
ROOT_OF_PROBLEMS = {"__init__.py", "manifest.py", "kernelize.py", "hf.py", "jax/__init__.py"}


def _source(family: str) -> Path:
    return ROOT / "packages" / family / "src" / "openkernels" / family


def _modules(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _problems(family: str) -> list[Path]:
    """The packages that hold one problem each: the family itself, or its sub-packages."""
    src = _source(family)
    if (src / "api.py").exists():
        return [src]
    return sorted(p.parent for p in src.glob("*/api.py"))


def _allowed(module: str, family: str, prefix: str) -> bool:
    name = f"{prefix}{module}"
    for role in ROLES | FAMILY_DATA.get(family, set()):
        if role.endswith("/*"):
            if module.startswith(role[:-1]):
                return True
        elif name == role or module == role:
            return True
    return False


@pytest.mark.parametrize("family", _families())
def test_every_problem_has_the_required_modules(family: str) -> None:
    problems = _problems(family)
    assert problems, f"{family}: no api.py at the family root or in a sub-package"
    for problem in problems:
        present = set(_modules(problem))
        missing = sorted(REQUIRED - present)
        assert not missing, f"{problem.relative_to(ROOT)} lacks {missing}"


@pytest.mark.parametrize("family", _families())
def test_no_module_outside_the_layout(family: str) -> None:
    src = _source(family)
    problems = _problems(family)
    strays = []
    for problem in problems:
        prefix = "" if problem == src else f"{problem.name}/"
        strays += [f"{prefix}{m}" for m in _modules(problem) if not _allowed(m, family, prefix)]
    if problems != [src]:
        inside = {p.name for p in problems}
        strays += [m for m in _modules(src) if m.split("/")[0] not in inside and m not in ROOT_OF_PROBLEMS]
    assert not strays, f"{family}: modules the layout does not name: {strays} (docs/adding-a-kernel.md)"


def test_the_doc_names_every_role() -> None:
    doc = (ROOT / "docs" / "adding-a-kernel.md").read_text()
    for role in sorted(ROLES):
        name = role.split("/")[-1].replace("*", "").rstrip("/") or role.split("/")[0]
        assert (name or role) in doc, f"docs/adding-a-kernel.md does not name {role}"
    for data in set().union(*FAMILY_DATA.values()):
        assert Path(data).name in doc, f"docs/adding-a-kernel.md does not name {data}"
