#!/usr/bin/env python
"""Unpack the source of every SGLang release the capture hooks are checked against (patches/sglang_releases.py)
that is not the one installed here, for tests/test_sglang.py, which reads each release's source with ast.

    python scripts/fetch_sglang_source.py        # scripts/setup_env.sh runs it; a release already unpacked is kept

One SGLang can be installed at a time (requirements-test.txt installs the newest checked release), so the others
are unpacked, not installed: `pip download --no-deps` fetches the release's wheel from PyPI (the CPython 3.11
x86-64 Linux one, whatever this machine is: only its Python files are used), and its `sglang/**/*.py` files go to
.venv/sglang-src/VERSION/sglang/ (ignored by git). Nothing of it is imported.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from patches.sglang_releases import CHECKED_VERSIONS

REPO = Path(__file__).resolve().parents[1]
SOURCE_FOLDER = REPO / ".venv" / "sglang-src"  # tests/sglang_source.py reads the releases from here
# The wheel pip fetches, the same on every machine (SGLang publishes only CPython x86-64 Linux wheels).
WHEEL_TAGS = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
              "--platform", "manylinux_2_34_x86_64"]


def release_folder(version: str) -> Path:
    """Where a release's `sglang` package source is unpacked."""
    return SOURCE_FOLDER / version


def installed_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def download_wheel(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *WHEEL_TAGS, f"sglang=={version}",
                    "-d", str(into)], check=True)
    [wheel] = into.glob(f"sglang-{version}-*.whl")
    return wheel


def unpack_source(wheel: Path, folder: Path) -> int:
    """The wheel's sglang/**/*.py files into `folder`, made whole under a temporary name and then renamed, so a
    folder that exists is complete. Returns the number of files."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if name.startswith("sglang/") and name.endswith(".py")]
        archive.extractall(partial, members=names)
    shutil.rmtree(folder, ignore_errors=True)  # an earlier folder missing its files
    partial.rename(folder)
    return len(names)


def main() -> int:
    installed = installed_version()
    for version in CHECKED_VERSIONS:
        folder = release_folder(version)
        if version == installed or (folder / "sglang" / "__init__.py").is_file():
            continue
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as download:
            count = unpack_source(download_wheel(version, Path(download)), folder)
        print(f"SGLang {version}: {count} source files in {folder.relative_to(REPO)}/sglang")
    return 0


if __name__ == "__main__":
    sys.exit(main())
