"""README.md as a new user meets it: every ```python block runs as written on a CPU, and the
test command at the top is the one CI (.ci/run) runs."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _python_blocks() -> list[tuple[int, str]]:
    """(line of the opening fence, code) for every ```python block of README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


# Calls that need a family the block does not import.
_NEEDS = {"quantize=": "openkernels.quant"}  # kernelize(model, quantize="int4")


def _imported_packages(code: str) -> list[str]:
    """What a block imports, as the distributions provide it: `openkernels.<family>` for the
    families, the top-level name for the rest (torch, transformers, jax); and what its calls
    need (_NEEDS)."""
    names = []
    for node in ast.walk(ast.parse(code)):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        for module in modules:
            parts = module.split(".")
            names.append(".".join(parts[:2]) if parts[0] == "openkernels" else parts[0])
    names += [package for call, package in _NEEDS.items() if call in code]
    return list(dict.fromkeys(names))


BLOCKS = _python_blocks()


def test_readme_has_the_snippets():
    """The fence pattern still finds the README's blocks (one per family, kernelize, JAX)."""
    assert len(BLOCKS) >= 7, [line for line, _ in BLOCKS]


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_snippet_runs(line, code, capsys):
    """Each block in a fresh namespace, in this process (torch is imported once; ~10 s for all
    seven here). A block skips only when a package it imports is not installed: a family left
    out by `nox -s test-cpu -- <family>`, or JAX on Python 3.10 (JAX 0.8.2+ needs 3.11)."""
    for name in _imported_packages(code):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"README.md:{line} imports {name}, which is not installed here")
    namespace = {"__name__": f"README.md:{line}"}
    # Padded so that a traceback names the README's own line numbers.
    exec(compile("\n" * line + code, str(README), "exec"), namespace)
    capsys.readouterr()  # the blocks print reports and explanations; nothing to check there


def test_readme_test_command_is_the_ci_command():
    """The second command at the top of the README is what .ci/run runs on every commit."""
    text = README.read_text()
    top = text[text.index("## Two commands") : text.index("## Install")]
    commands = re.findall(r"^```bash\n(.*?)\n```$", top, re.DOTALL | re.MULTILINE)
    assert commands[0].startswith("pip install nox") and commands[0].endswith("nox -s demo"), commands
    assert commands[1] == "nox -s test-cpu", commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^\s*{re.escape(commands[1])}\s*$", ci, re.MULTILINE), ci
    assert text.index("## Two commands") < text.index("## Install") < text.index("## Activations")


def test_readme_package_versions_are_the_packages():
    """The package table's version column is each package's `__version__` (it read 0.5.x for
    many releases after the packages had moved on)."""
    text = README.read_text()
    rows = re.findall(r"^\| `openkernels-(\w+)` \([^)]*\) \| `([\w.]+)` \| ([\d.]+) \|", text, re.MULTILINE)
    assert {name for name, _, _ in rows} == {"shared", "activations", "layernorm", "attention", "quant"}, rows
    for _, module, version in rows:
        source = ROOT / ("shared" if module == "openkernels.shared" else f"packages/{module.split('.')[1]}")
        init = source / "src" / Path(*module.split(".")) / "__init__.py"
        declared = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.MULTILINE)
        assert declared and declared.group(1) == version, (module, version, declared and declared.group(1))
