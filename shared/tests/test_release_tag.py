"""The release workflow's tag check (.ci/release_tag.py): a `<family>-v<version>` tag names a
package and its declared __version__, and the built files are that package at that version."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "release_tag.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


def _version(init: Path) -> str:
    return re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.MULTILINE).group(1)


def test_each_package_tag_at_its_version_names_its_folder() -> None:
    for family, folder in [("shared", "shared")] + [(p.name, f"packages/{p.name}") for p in
                                                    sorted((ROOT / "packages").iterdir()) if (p / "pyproject.toml").exists()]:  # fmt: skip
        version = _version(ROOT / folder / "src" / "openkernels" / family / "__init__.py")
        done = _run(f"{family}-v{version}")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == folder


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("attention-v0.0.1", "declares __version__"),
        ("nosuch-v1.0.0", "is no package"),
        ("attention-1.0.0", "is not <family>-v"),
        ("attention-v1.0", "is not <family>-v"),
    ],
)
def test_a_wrong_tag_fails_with_the_reason(tag: str, message: str) -> None:
    done = _run(tag)
    assert done.returncode == 1 and message in done.stderr, (done.returncode, done.stderr)


def test_dist_must_hold_that_package_at_that_version(tmp_path: Path) -> None:
    version = _version(ROOT / "packages" / "quant" / "src" / "openkernels" / "quant" / "__init__.py")
    tag = f"quant-v{version}"
    stem = f"openkernels_quant-{version}"
    (tmp_path / f"{stem}-py3-none-any.whl").touch()
    (tmp_path / f"{stem}.tar.gz").touch()
    assert _run(tag, "--dist", str(tmp_path)).returncode == 0
    (tmp_path / "openkernels_quant-9.9.9.tar.gz").touch()  # a stray file
    assert "one wheel and one sdist" in _run(tag, "--dist", str(tmp_path)).stderr
    (tmp_path / "openkernels_quant-9.9.9.tar.gz").unlink()
    (tmp_path / f"{stem}.tar.gz").rename(tmp_path / "openkernels_layernorm-0.1.0.tar.gz")
    assert "are not openkernels-quant" in _run(tag, "--dist", str(tmp_path)).stderr
