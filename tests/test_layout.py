"""The repository's shape as the README describes it: every library module listed in its Layout section, every
listed path real, thin stage scripts, and no flag a stage accepts without reading it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.cli.flags import FLAGS, STAGE_FLAGS

REPO = Path(__file__).resolve().parents[1]
STAGE_SCRIPTS = sorted(REPO.glob("0[1-5]_*.py"))


def layout_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    return section.split("```")[1]


def listed_modules() -> set[str]:
    """common/<package>/ and patches/ lines name their modules after the folder (continued on indented lines);
    common/x.py lines name themselves."""
    modules, package = set(), None
    for line in layout_block().splitlines():
        head = re.match(r"((?:common|patches)/(?:\w+/)?)(\S*)", line)
        if head:
            package = head.group(1) if head.group(1).endswith("/") and not head.group(2) else None
            if head.group(2).endswith(".py"):
                modules.add(head.group(1) + head.group(2))
        elif line[:1].strip():  # another top-level path: the package's lines have ended
            package = None
        if package:
            modules.update(package + name for name in re.findall(r"\b(\w+\.py)\b", line))
    return modules


def test_readme_layout_lists_every_library_module_and_nothing_else():
    on_disk = {str(p.relative_to(REPO)) for folder in ("common", "patches") for p in (REPO / folder).rglob("*.py")
               if p.name != "__init__.py"}
    listed = listed_modules()
    assert sorted(on_disk - listed) == [], "modules missing from the README's Layout section"
    assert sorted(listed - on_disk) == [], "the README's Layout section names modules that do not exist"


def listed_scripts(folder: str) -> set[str]:
    """The script names on the Layout lines of one scripts folder ("scripts/" or "scripts/lab/"): its first line
    and the indented lines under it."""
    names, inside = set(), False
    for line in layout_block().splitlines():
        if line[:1].strip():  # a top-level path starts a new entry
            inside = line.split()[0] == folder
        if inside:
            names.update(re.findall(r"\b\w+\.(?:py|sh)\b", line))
    return names


@pytest.mark.parametrize("folder", ["scripts/", "scripts/lab/"])
def test_readme_layout_lists_every_script_in_its_folder(folder):
    """scripts/ holds the user's tools and scripts/lab/ the lab: each listed under its own folder, none elsewhere."""
    on_disk = {p.name for p in (REPO / folder).iterdir() if p.suffix in (".py", ".sh")}
    listed = listed_scripts(folder)
    assert sorted(on_disk - listed) == [], f"scripts in {folder} missing from its line in the README's Layout section"
    assert sorted(listed - on_disk) == [], f"the README's Layout line for {folder} names scripts not there"


def test_every_top_level_path_in_the_layout_exists():
    for line in layout_block().splitlines():
        first = line.split()[0] if line.strip() and not line.startswith(" ") else None
        if first and "..." not in first:
            assert (REPO / first).exists(), f"README Layout names {first}, which does not exist"


def test_stage_scripts_are_thin():
    for script in STAGE_SCRIPTS:
        lines = len(script.read_text().splitlines())
        assert lines <= 200, f"{script.name} has {lines} lines: move its logic into common/"


def test_library_modules_read_in_one_sitting():
    for module in (REPO / "common").rglob("*.py"):
        lines = len(module.read_text().splitlines())
        assert lines <= 500, f"{module.relative_to(REPO)} has {lines} lines: split it by concern"


def test_every_flag_a_stage_accepts_is_read_by_the_code():
    """A flag accepted and never applied (as --drafter-config once was) costs a user a whole run."""
    code = "\n".join(p.read_text() for p in [*STAGE_SCRIPTS, *(REPO / "common").rglob("*.py")]
                     if p.name != "flags.py")
    for stage, names in STAGE_FLAGS.items():
        for name in names:
            dest = FLAGS[name].dest
            if dest in ("run_dir",):  # resolved into the path flags by common.cli.flags itself
                continue
            assert re.search(rf"\.{dest}\b|['\"]{dest}['\"]", code), f"{stage} accepts {name} but no code reads it"


def test_requirements_files_name_only_files_that_exist():
    """A comment pointing at a file that is not there (requirements-sglang.txt once) sends a new user nowhere."""
    for requirements in REPO.glob("requirements*.txt"):
        for name in re.findall(r"[\w./-]+\.(?:txt|py|sh|md|toml|cfg)\b", requirements.read_text()):
            assert (REPO / name).exists(), f"{requirements.name} names {name}, which does not exist"
