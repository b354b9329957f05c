"""The repository's shape as the README describes it: every library module listed in its Layout section, every
listed path real, thin stage scripts, and no flag a stage accepts without reading it."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.cli.flags import FLAGS, STAGE_FLAGS

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "eagle3_pipeline"
STAGE_SCRIPTS = sorted(REPO.glob("0[1-5]_*.py"))


def layout_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    return section.split("```")[1]


def listed_modules() -> set[str]:
    """eagle3_pipeline/<package>/ and patches/ lines name their modules after the folder (continued on indented
    lines); eagle3_pipeline/x.py lines name themselves."""
    modules, package = set(), None
    for line in layout_block().splitlines():
        head = re.match(r"((?:eagle3_pipeline|patches)/(?:\w+/)?)(\S*)", line)
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
    on_disk = {str(p.relative_to(REPO)) for folder in (PACKAGE.name, "patches") for p in (REPO / folder).rglob("*.py")
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
        assert lines <= 200, f"{script.name} has {lines} lines: move its logic into eagle3_pipeline/"


def test_library_modules_read_in_one_sitting():
    for module in PACKAGE.rglob("*.py"):
        lines = len(module.read_text().splitlines())
        assert lines <= 500, f"{module.relative_to(REPO)} has {lines} lines: split it by concern"


def test_every_flag_a_stage_accepts_is_read_by_the_code():
    """A flag accepted and never applied (as --drafter-config once was) costs a user a whole run."""
    code = "\n".join(p.read_text() for p in [*STAGE_SCRIPTS, *PACKAGE.rglob("*.py")]
                     if p.name != "flags.py")
    for stage, names in STAGE_FLAGS.items():
        for name in names:
            dest = FLAGS[name].dest
            if dest in ("run_dir",):  # resolved into the path flags by eagle3_pipeline.cli.flags itself
                continue
            assert re.search(rf"\.{dest}\b|['\"]{dest}['\"]", code), f"{stage} accepts {name} but no code reads it"


def test_requirements_files_name_only_files_that_exist():
    """A comment pointing at a file that is not there (requirements-sglang.txt once) sends a new user nowhere."""
    for requirements in REPO.glob("requirements*.txt"):
        for name in re.findall(r"[\w./-]+\.(?:txt|py|sh|md|toml|cfg)\b", requirements.read_text()):
            assert (REPO / name).exists(), f"{requirements.name} names {name}, which does not exist"


# --- the package, and how every script finds it ---------------------------------------------------------------

# A script finds the library as the installed package (scripts/setup_env.sh installs it editable) or, on a machine
# where the repository is only unpacked, through the PYTHONPATH its shell script sets: never by editing sys.path.
SYS_PATH_EDIT = re.compile(r"sys\.path\.(?:insert|append)\b|sys\.path\[")


def repository_files(*suffixes: str) -> list[Path]:
    """The repository's own files with these suffixes: not under hidden folders (.venv, .git) or runs/."""
    found = []
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders
                         if not name.startswith(".") and name not in ("runs", "__pycache__")]
        found += [Path(folder) / name for name in files if name.endswith(suffixes)]
    return sorted(found)


def test_no_file_edits_sys_path():
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in repository_files(".py", ".sh")
             for number, line in enumerate(path.read_text().splitlines(), 1) if SYS_PATH_EDIT.search(line)]
    assert found == [], "import the package instead (the shell scripts put the repository on PYTHONPATH)"


def test_every_shell_script_puts_the_repository_on_pythonpath():
    """On a GPU machine the repository is unpacked, not installed: a script's Python finds the package through
    the PYTHONPATH its shell script sets right after it moves to the repository root."""
    export = 'export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"'
    for script in sorted([*REPO.glob("scripts/*.sh"), *REPO.glob("scripts/lab/*.sh")]):
        lines = script.read_text().splitlines()
        moves = [i for i, line in enumerate(lines) if re.fullmatch(r'cd "\$\(dirname "\$0"\)/\.\.(/\.\.)?"', line)]
        assert len(moves) == 1, f"{script.relative_to(REPO)}: no single cd to the repository root"
        assert lines[moves[0] + 1].startswith(export), f"{script.relative_to(REPO)}: {export} must follow its cd"


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # the standard library's from Python 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_package_pyproject_names_is_the_library_folder():
    project = pyproject()
    assert project["project"]["name"].replace("-", "_") == PACKAGE.name
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert f"{PACKAGE.name}*" in included
    for pattern in included:
        package = REPO / pattern.rstrip("*")
        assert (package / "__init__.py").is_file(), f"pyproject.toml includes {pattern}: no such package"


def test_pyproject_depends_on_what_requirements_txt_lists():
    """setup_env.sh installs requirements.txt, then the project with --no-deps: the two lists must agree."""
    listed = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    project = pyproject()["project"]
    declared = project["dependencies"] + [spec for specs in project["optional-dependencies"].values() for spec in specs]
    assert sorted(declared) == sorted(spec for spec in listed if spec)


def test_the_installed_package_is_this_checkout(tmp_path):
    """From another folder, without PYTHONPATH, this Python imports the package from here: setup_env.sh's editable
    install, so the scripts outside the repository root find it."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    found = subprocess.run([sys.executable, "-c", "import eagle3_pipeline; print(eagle3_pipeline.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert found.returncode == 0, f"eagle3_pipeline is not installed in {sys.executable}: run scripts/setup_env.sh"
    assert Path(found.stdout.strip()).resolve() == (PACKAGE / "__init__.py").resolve()


# --- imports run one way -------------------------------------------------------------------------------------

# eagle3_pipeline/'s packages, lowest first: a module imports from its own package or lower ones, never higher. Below
# them all is the ground floor, every module directly in eagle3_pipeline/ (errors, log, progress, distributed, ...),
# which imports nothing of the packages. The README's Layout section states this order (checked below).
LAYERS = ("formats", "model", "verifier", "extract", "data", "train", "bench", "peer", "cli", "lab")
GROUND = "ground floor"


def package_of(module: str, root: Path) -> str | None:
    """'eagle3_pipeline.formats.files' -> 'formats'; 'eagle3_pipeline.errors' -> 'errors', a ground-floor module;
    None outside."""
    parts = module.split(".")
    return parts[1] if parts[0] == root.name and len(parts) > 1 else None


def layer_of(package: str, root: Path) -> int:
    """0 for a ground-floor module, 1 + its place in LAYERS for a package; a package not in LAYERS fails."""
    if (root / f"{package}.py").is_file():
        return 0
    assert package in LAYERS, f"{root.name}/{package}/ has no layer: add it to LAYERS in tests/test_layout.py"
    return 1 + LAYERS.index(package)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, top-level and inside functions alike; `from eagle3_pipeline
    import errors` gives eagle3_pipeline.errors, and relative imports are resolved against the file's package."""
    own = list(path.relative_to(root.parent).with_suffix("").parts)[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = own[:len(own) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == root.name or (node.level and not node.module):  # `from eagle3_pipeline import errors`
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


def test_every_package_of_the_library_has_a_layer():
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert sorted(set(packages) - set(LAYERS)) == [], "packages of eagle3_pipeline/ missing from LAYERS"
    assert sorted(set(LAYERS) - set(packages)) == [], "LAYERS names packages eagle3_pipeline/ does not have"


def test_no_module_imports_a_higher_layer():
    """A lower layer importing a higher one ties them into one: the fix is to move the borrowed thing down to
    where it belongs, not to hide the import inside a function (those count too)."""
    assert upward_imports(PACKAGE) == []


def test_no_cycle_between_packages():
    root = PACKAGE
    where = {(source, target): line for source, target, line in package_imports(root)}
    cycles = package_cycles(root)
    assert cycles == [], "\n".join(" -> ".join(cycle) + ": " + "; ".join(
        where[pair] for pair in zip(cycle, cycle[1:])) for cycle in cycles)


def test_the_layer_checks_find_a_planted_upward_import_and_cycle(tmp_path):
    """The checks above on a small tree of real files: an upward import inside a function and a relative one are
    found, `from eagle3_pipeline import log` counts as importing eagle3_pipeline.log (the two ground-floor modules
    importing each other make a cycle), and a package without a layer is named."""
    root = tmp_path / "eagle3_pipeline"
    files = {"__init__.py": "", "errors.py": "from eagle3_pipeline import log\n",
             "log.py": "import eagle3_pipeline.errors\n",
             "formats/__init__.py": "", "formats/files.py": "from eagle3_pipeline.errors import UsageError\n",
             "formats/checkpoint.py": "def load():\n    from eagle3_pipeline.model.drafter import Eagle3Drafter\n",
             "formats/manifest.py": "from ..cli import flags\n",
             "model/__init__.py": "", "model/drafter.py": "from eagle3_pipeline.errors import UsageError\n",
             "cli/__init__.py": "", "cli/flags.py": ""}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert upward_imports(root) == [
        "eagle3_pipeline/formats/checkpoint.py:2 imports eagle3_pipeline.model.drafter (model, above formats)",
        "eagle3_pipeline/formats/manifest.py:1 imports eagle3_pipeline.cli (cli, above formats)"]
    assert package_cycles(root) == [["errors", "log", "errors"]]
    (root / "lab").mkdir()
    (root / "lab" / "__init__.py").write_text("")
    (root / "lab" / "run.py").write_text("import eagle3_pipeline.errors\n")
    (root / "extra").mkdir()
    (root / "extra" / "__init__.py").write_text("")
    (root / "extra" / "run.py").write_text("import eagle3_pipeline.errors\n")
    with pytest.raises(AssertionError, match="eagle3_pipeline/extra/ has no layer"):
        upward_imports(root)


def test_the_readme_states_the_layer_order():
    """The Layout section's one line on import direction names LAYERS in order, so a reader and the test agree."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout"):].split("```")[0]
    stated = re.search(r"lowest first:([^.]*)\.", " ".join(section.split()))
    assert stated, "README's Layout section lacks the 'Imports run one way, lowest first: ...' sentence"
    names = re.findall(r"`eagle3_pipeline/(\w+)/`", stated.group(1))
    assert names == list(LAYERS), f"README states the layers as {names}, tests/test_layout.py as {list(LAYERS)}"
