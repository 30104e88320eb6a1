"""The openkernels pytest plugin is opt-in: the repository's configuration loads it, the
installed package registers nothing with pytest (it would set OPENKERNELS_STRICT=1 in every
user's test run)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_no_package_registers_a_pytest_entry_point():
    projects = [ROOT / "shared", *sorted((ROOT / "packages").iterdir())]
    for project in (p for p in projects if (p / "pyproject.toml").exists()):
        assert "pytest11" not in (project / "pyproject.toml").read_text(), project.name


def test_the_repository_configuration_loads_it(pytestconfig: pytest.Config):
    assert "-p openkernels.shared.dev.testing.plugin" in (ROOT / "pyproject.toml").read_text()
    assert pytestconfig.pluginmanager.has_plugin("openkernels.shared.dev.testing.plugin")
    assert os.environ.get("OPENKERNELS_STRICT") == "1"
    assert "openkernels.shared.dev.testing.plugin" in sys.modules
