"""The repository's shape as the README describes it: every library module listed in its Layout section, every
listed path real, thin stage scripts, and no flag a stage accepts without reading it."""
from __future__ import annotations

import ast
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


# --- imports run one way -------------------------------------------------------------------------------------

# common/'s packages, lowest first: a module imports from its own package or lower ones, never higher. Below them
# all is the ground floor, every module directly in common/ (errors, log, progress, distributed, ...), which
# imports nothing of the packages. The README's Layout section states this order (checked below).
LAYERS = ("formats", "model", "verifier", "extract", "data", "train", "bench", "peer", "cli", "lab")
GROUND = "ground floor"


def package_of(module: str, root: Path) -> str | None:
    """'common.formats.files' -> 'formats'; 'common.errors' -> 'errors', a ground-floor module; None outside."""
    parts = module.split(".")
    return parts[1] if parts[0] == root.name and len(parts) > 1 else None


def layer_of(package: str, root: Path) -> int:
    """0 for a ground-floor module, 1 + its place in LAYERS for a package; a package not in LAYERS fails."""
    if (root / f"{package}.py").is_file():
        return 0
    assert package in LAYERS, f"{root.name}/{package}/ has no layer: add it to LAYERS in tests/test_layout.py"
    return 1 + LAYERS.index(package)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, top-level and inside functions alike; `from common
    import errors` gives common.errors, and relative imports are resolved against the file's package."""
    own = list(path.relative_to(root.parent).with_suffix("").parts)[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = own[:len(own) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == root.name or (node.level and not node.module):  # `from common import errors`
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def package_imports(root: Path) -> list[tuple[str, str, str]]:
    """(importing package, imported package, 'file:line imports module') for every import across packages."""
    edges = []
    for path in sorted(root.rglob("*.py")):
        dotted = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        source = package_of(dotted, root)
        for line, module in imported_modules(path, root):
            target = package_of(module, root)
            if source and target and target != source:
                edges.append((source, target, f"{path.relative_to(root.parent)}:{line} imports {module}"))
    return edges


def upward_imports(root: Path) -> list[str]:
    """Each import of a higher layer, naming the file, the line and both layers."""
    def name(package):
        return GROUND if layer_of(package, root) == 0 else package

    return [f"{where} ({name(target)}, above {name(source)})" for source, target, where in package_imports(root)
            if layer_of(target, root) > layer_of(source, root)]


def package_cycles(root: Path) -> list[list[str]]:
    """Every cycle of the package graph found by a depth-first walk, each as its packages in order."""
    graph: dict[str, set[str]] = {}
    for source, target, _ in package_imports(root):
        graph.setdefault(source, set()).add(target)
    cycles, done = [], set()

    def walk(package, path):
        if package in path:
            cycles.append(path[path.index(package):] + [package])
            return
        if package in done:
            return
        for target in sorted(graph.get(package, ())):
            walk(target, path + [package])
        done.add(package)

    for package in sorted(graph):
        walk(package, [])
    return cycles


def test_every_package_of_common_has_a_layer():
    packages = sorted(p.parent.name for p in (REPO / "common").glob("*/__init__.py"))
    assert sorted(set(packages) - set(LAYERS)) == [], "packages of common/ missing from LAYERS"
    assert sorted(set(LAYERS) - set(packages)) == [], "LAYERS names packages common/ does not have"


def test_no_module_imports_a_higher_layer():
    """A lower layer importing a higher one ties them into one: the fix is to move the borrowed thing down to
    where it belongs, not to hide the import inside a function (those count too)."""
    assert upward_imports(REPO / "common") == []


def test_no_cycle_between_packages():
    root = REPO / "common"
    where = {(source, target): line for source, target, line in package_imports(root)}
    cycles = package_cycles(root)
    assert cycles == [], "\n".join(" -> ".join(cycle) + ": " + "; ".join(
        where[pair] for pair in zip(cycle, cycle[1:])) for cycle in cycles)


def test_the_layer_checks_find_a_planted_upward_import_and_cycle(tmp_path):
    """The checks above on a small tree of real files: an upward import inside a function and a relative one are
    found, `from common import log` counts as importing common.log (the two ground-floor modules importing each
    other make a cycle), and a package without a layer is named."""
    root = tmp_path / "common"
    files = {"__init__.py": "", "errors.py": "from common import log\n", "log.py": "import common.errors\n",
             "formats/__init__.py": "", "formats/files.py": "from common.errors import UsageError\n",
             "formats/checkpoint.py": "def load():\n    from common.model.drafter import Eagle3Drafter\n",
             "formats/manifest.py": "from ..cli import flags\n",
             "model/__init__.py": "", "model/drafter.py": "from common.errors import UsageError\n",
             "cli/__init__.py": "", "cli/flags.py": ""}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert upward_imports(root) == [
        "common/formats/checkpoint.py:2 imports common.model.drafter (model, above formats)",
        "common/formats/manifest.py:1 imports common.cli (cli, above formats)"]
    assert package_cycles(root) == [["errors", "log", "errors"]]
    (root / "lab").mkdir()
    (root / "lab" / "__init__.py").write_text("")
    (root / "lab" / "run.py").write_text("import common.errors\n")
    (root / "extra").mkdir()
    (root / "extra" / "__init__.py").write_text("")
    (root / "extra" / "run.py").write_text("import common.errors\n")
    with pytest.raises(AssertionError, match="common/extra/ has no layer"):
        upward_imports(root)


def test_the_readme_states_the_layer_order():
    """The Layout section's one line on import direction names LAYERS in order, so a reader and the test agree."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout"):].split("```")[0]
    stated = re.search(r"lowest first:([^.]*)\.", " ".join(section.split()))
    assert stated, "README's Layout section lacks the 'Imports run one way, lowest first: ...' sentence"
    names = re.findall(r"`common/(\w+)/`", stated.group(1))
    assert names == list(LAYERS), f"README states the layers as {names}, tests/test_layout.py as {list(LAYERS)}"
