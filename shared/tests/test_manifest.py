"""Family manifests: each family of the repository declares itself once, and the shared tools
(CLI, kernelize, dispatch's family import, the asv configuration) agree with the declarations."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from openkernels.shared import manifest
from openkernels.shared.dev import cli
from openkernels.shared.kernelize import available_swaps

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAMILY_DIRS = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))


def test_every_family_of_the_repository_has_a_manifest() -> None:
    assert FAMILY_DIRS and set(manifest.families()) >= set(FAMILY_DIRS)


@pytest.mark.parametrize("family", FAMILY_DIRS)
def test_a_manifest_matches_its_package_and_pyproject(family: str) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    m = manifest.families()[family]
    project = tomllib.loads((ROOT / "packages" / family / "pyproject.toml").read_text())["project"]
    assert m.name == family and m.distribution == project["name"]
    assert project["entry-points"]["openkernels.families"] == {
        family: f"openkernels.{family}.manifest:MANIFEST"
    }
    assert "openkernels.kernelize" not in project["entry-points"]  # one entry point per family
    assert m.bench and m.bench[0].rpartition(".")[2] == "bench"  # the headline: "bench" or "<problem>.bench"
    modules = m.bench_modules()
    assert [mod.__name__ for mod in modules] == [f"openkernels.{family}.{name}" for name in m.bench]
    assert all(hasattr(mod, "cases") or hasattr(mod, "checks") for mod in modules)
    assert callable(manifest.resolve(m.kernelize))
    assert (ROOT / "benchmarks" / "asv_suite" / f"{m.asv_suite}.py").is_file()


def test_the_tools_read_the_manifests() -> None:
    families = manifest.families()
    assert cli.families() == [name for name, m in families.items() if m.bench]
    assert [mod.__name__ for mod in cli._bench_modules("attention")] == [
        f"openkernels.attention.{name}" for name in families["attention"].bench
    ]
    assert set(available_swaps()) >= set(FAMILY_DIRS)


def test_asv_uninstalls_exactly_the_distributions_of_the_manifests() -> None:
    config = json.loads((ROOT / "asv.conf.json").read_text())
    (command,) = config["uninstall_command"]
    named = set(command.split("uninstall -y", 1)[1].split())
    assert named == {"openkernels-shared", *(m.distribution for m in manifest.families().values())}


def test_a_source_checkout_without_entry_points_is_found_on_the_namespace_path(tmp_path, monkeypatch) -> None:
    # A family on PYTHONPATH (the GPU machine runs the tree that way): its manifest module.
    package = tmp_path / "openkernels" / "toyfamily"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "manifest.py").write_text(
        "from openkernels.shared.manifest import FamilyManifest\n"
        "MANIFEST = FamilyManifest(name='toyfamily', distribution='openkernels-toyfamily', bench=())\n"
    )
    import openkernels

    monkeypatch.setattr(openkernels, "__path__", [*openkernels.__path__, str(package.parent)])
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = manifest.families()
        assert found["toyfamily"].distribution == "openkernels-toyfamily"
        assert "toyfamily" not in cli.families()  # no bench modules: not a CLI family
    finally:
        sys.modules.pop("openkernels.toyfamily.manifest", None)
        sys.modules.pop("openkernels.toyfamily", None)
