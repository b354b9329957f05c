"""Reading a checked SGLang release's source with `ast`, without importing it (its imports need GPU packages).

Each release the capture hooks are checked against (patches/sglang_releases.py) is read from the installed sglang
package when that is the release (found with importlib.util.find_spec, which does not run its __init__), or else
from the source scripts/fetch_sglang_source.py unpacked into .venv/sglang-src/VERSION/.
"""
from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import pytest

from patches.sglang_releases import RELEASES

REPO = Path(__file__).resolve().parents[1]
SOURCE_FOLDER = REPO / ".venv" / "sglang-src"  # scripts/fetch_sglang_source.py writes here
SETUP = "bash scripts/setup_env.sh (or .venv/bin/python scripts/fetch_sglang_source.py)"


def installed_root() -> Path | None:
    """The installed sglang package folder, None when SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def installed_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def release_root(version: str) -> Path | None:
    """The sglang package folder holding a release's source: the installed one when it is that release, else the
    unpacked one; None when neither is here."""
    root = installed_root()
    if root is not None and installed_version() == version:
        return root
    unpacked = SOURCE_FOLDER / version / "sglang"
    return unpacked if (unpacked / "__init__.py").is_file() else None


def release_source(version: str) -> "ReleaseSource":
    """A checked release's source; skips the test, naming the setup command, when it is not here."""
    root = release_root(version)
    if root is None:
        pytest.skip(f"SGLang {version}'s source is not here (neither installed nor in {SOURCE_FOLDER}): {SETUP}")
    return ReleaseSource(version, root)


def installed_source() -> "ReleaseSource":
    """The installed SGLang's source, whatever release it is; skips the test when SGLang is not installed."""
    root = installed_root()
    if root is None:
        pytest.skip("SGLang is not installed (CI installs the newest checked release from requirements-test.txt "
                    "with --no-deps: pip install --no-deps -r requirements-test.txt)")
    return ReleaseSource(installed_version(), root)


# The installed release, for tests of what runs here whatever release it is (the launch command, engine settings).

def sglang_root() -> Path:
    return installed_source().root


def parse(module: str) -> ast.Module:
    return installed_source().parse(module)


def server_args_fields() -> dict[str, bool]:
    return installed_source().server_args_fields()


_TEXT: dict[int, str] = {}  # id(tree) -> the file's text, for source_of


@lru_cache(maxsize=None)
def _parse_file(path: Path) -> ast.Module:
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    for node in ast.walk(tree):
        node._sglang_module = id(tree)
    _TEXT[id(tree)] = text
    return tree


class ReleaseSource:
    """One release's source (`root`, the sglang package folder) and, for a checked release, its entry in the release
    table (`release`)."""

    def __init__(self, version: str, root: Path):
        self.version = version
        self.release = RELEASES.get(version)
        self.root = root

    def __repr__(self) -> str:
        return f"SGLang {self.version} at {self.root}"

    def parse(self, module: str) -> ast.Module:
        """The syntax tree of a module of this release, e.g. "sglang.srt.models.llama"."""
        path = self.root.joinpath(*module.split(".")[1:]).with_suffix(".py")
        if not path.is_file():
            raise AssertionError(f"{module}: no {path} in SGLang {self.version}")
        return _parse_file(path)

    def find_class(self, module: str, name: str) -> ast.ClassDef:
        for node in self.parse(module).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"{module} defines no class {name} in SGLang {self.version}")

    def find_method(self, module: str, class_name: str, name: str) -> ast.FunctionDef:
        for node in self.find_class(module, class_name).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        raise AssertionError(f"{module}.{class_name} defines no method {name} in SGLang {self.version}")

    def find_function(self, module: str, name: str) -> ast.FunctionDef:
        for node in ast.walk(self.parse(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        raise AssertionError(f"{module} defines no function {name} in SGLang {self.version}")

    def class_fields(self, module: str, class_name: str) -> set[str]:
        """Annotated fields (dataclass / msgspec style) and enum members of a class."""
        names = set()
        for node in self.find_class(module, class_name).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        return names

    def module_constant(self, module: str, name: str):
        """The literal value assigned to a module-level name."""
        for node in self.parse(module).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return ast.literal_eval(node.value)
        raise AssertionError(f"{module} assigns no constant {name} in SGLang {self.version}")

    def server_args_fields(self) -> dict[str, bool]:
        """Every ServerArgs field of this release -> whether it has a command-line flag. 0.5.17 declares them in
        the ServerArgs dataclass of srt/server_args.py, 0.5.23 in the msgspec namespaces of
        srt/arg_groups/fields/*.py (assembled into ServerArgs); both mark a field without a flag with
        Arg(no_cli=True) (its value can still be passed to sglang.Engine)."""
        classes = [self.find_class("sglang.srt.server_args", "ServerArgs")]
        for path in sorted((self.root / "srt" / "arg_groups" / "fields").glob("*.py")):
            tree = self.parse("sglang.srt.arg_groups.fields." + path.stem)
            classes += [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        fields = {}
        for node in classes:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                        and not item.target.id.startswith("_"):
                    fields[item.target.id] = not _no_cli(item.annotation)
        return fields


def _no_cli(annotation: ast.expr) -> bool:
    return any(isinstance(k, ast.keyword) and k.arg == "no_cli" and isinstance(k.value, ast.Constant)
               and k.value.value is True
               for call in ast.walk(annotation) if isinstance(call, ast.Call) for k in call.keywords)


def parameter_names(function: ast.FunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]


def self_attributes_assigned(function: ast.FunctionDef) -> dict[str, ast.expr]:
    """self.X = value assignments in a function body: {X: value}."""
    found = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    found[target.attr] = node.value
    return found


def source_of(node: ast.AST) -> str:
    """The node's text exactly as written in the file (quotes and spacing included)."""
    text = _TEXT[node._sglang_module]
    return text if isinstance(node, ast.Module) else ast.get_source_segment(text, node)
