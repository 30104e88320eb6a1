"""The release workflow's checks of a `<family>-v<version>` tag (.github/workflows/release.yml).

    python .ci/release_tag.py TAG               prints the package's folder (shared, packages/<family>)
    python .ci/release_tag.py TAG --dist DIR    also: DIR holds exactly that package's wheel and sdist
                                                at that version

Exits 1 with the reason when the tag names no package, is not `<family>-v<version>`, or its
version is not the package's `__version__` (the file [tool.hatch.version] points at). Reads
files only: nothing is imported or installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"(?P<family>[a-z][a-z0-9_]*)-v(?P<version>\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?)")
VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)
# pyproject.toml's [project] name and [tool.hatch.version] path (Python 3.10 has no tomllib).
NAME = re.compile(r"""^\[project\][^\[]*?^name\s*=\s*["']([^"']+)["']""", re.MULTILINE | re.DOTALL)
VERSION_PATH = re.compile(
    r"""^\[tool\.hatch\.version\][^\[]*?^path\s*=\s*["']([^"']+)["']""", re.MULTILINE | re.DOTALL
)


def projects() -> dict[str, Path]:
    """family -> package folder: shared and every packages/<family> with a pyproject.toml."""
    found = {"shared": ROOT / "shared"}
    found.update({p.parent.name: p.parent for p in sorted((ROOT / "packages").glob("*/pyproject.toml"))})
    return found


def package_version(project: Path) -> tuple[str, str]:
    """(distribution name, __version__) of the package in `project`."""
    meta = (project / "pyproject.toml").read_text()
    name, path = NAME.search(meta), VERSION_PATH.search(meta)
    if name is None or path is None:
        raise SystemExit(
            f"release_tag: {project.name}/pyproject.toml has no [project] name or [tool.hatch.version] path"
        )
    source = project / path.group(1)
    match = VERSION.search(source.read_text())
    if match is None:
        raise SystemExit(f"release_tag: no __version__ in {source.relative_to(ROOT)}")
    return name.group(1), match.group(1)


def check_dist(dist: Path, name: str, version: str) -> None:
    """DIR holds one wheel and one sdist, both of `name` at `version`."""
    stem = f"{name.replace('-', '_')}-{version}"
    files = sorted(p.name for p in dist.iterdir() if p.is_file())
    wheels = [f for f in files if f.endswith(".whl")]
    sdists = [f for f in files if f.endswith(".tar.gz")]
    if len(wheels) != 1 or len(sdists) != 1 or len(files) != 2:
        raise SystemExit(f"release_tag: {dist} must hold one wheel and one sdist, got {files}")
    if not wheels[0].startswith(f"{stem}-") or sdists[0] != f"{stem}.tar.gz":
        raise SystemExit(f"release_tag: {files} are not {name} {version}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag")
    parser.add_argument("--dist", type=Path, default=None)
    args = parser.parse_args(argv)
    match = TAG.fullmatch(args.tag)
    if match is None:
        raise SystemExit(f"release_tag: {args.tag!r} is not <family>-v<major>.<minor>.<patch>[a|b|rcN]")
    known = projects()
    family, version = match.group("family"), match.group("version")
    if family not in known:
        raise SystemExit(f"release_tag: {family!r} is no package; the packages are {sorted(known)}")
    project = known[family]
    name, declared = package_version(project)
    if declared != version:
        raise SystemExit(
            f"release_tag: tag {args.tag} says {version}, but {name} declares __version__ {declared}"
        )
    if args.dist is not None:
        check_dist(args.dist, name, version)
    print(project.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
