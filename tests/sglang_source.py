"""Reading the installed SGLang release's source with `ast`, without importing it (its imports need GPU packages).

The package is found with importlib.util.find_spec, which locates it without running its __init__.
"""
from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path

import pytest


def sglang_root() -> Path:
    """The installed sglang package folder; skips the test when SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed (CI installs the pinned release from requirements-test.txt with "
                    "--no-deps: pip install --no-deps -r requirements-test.txt)")
    return Path(list(spec.submodule_search_locations)[0])


_TEXT: dict[int, str] = {}  # id(tree) -> the file's text, for source_of


@lru_cache(maxsize=None)
def parse(module: str) -> ast.Module:
    """The syntax tree of a module of the installed sglang, e.g. "sglang.srt.models.llama"."""
    parts = module.split(".")
    path = sglang_root().joinpath(*parts[1:]).with_suffix(".py")
    if not path.is_file():
        raise AssertionError(f"{module}: no {path} in the installed SGLang")
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    for node in ast.walk(tree):
        node._sglang_module = id(tree)
    _TEXT[id(tree)] = text
    return tree


def find_class(module: str, name: str) -> ast.ClassDef:
    for node in parse(module).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{module} defines no class {name}")


def find_method(module: str, class_name: str, name: str) -> ast.FunctionDef:
    for node in find_class(module, class_name).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"{module}.{class_name} defines no method {name}")


def find_function(module: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(parse(module)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"{module} defines no function {name}")


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


def class_fields(module: str, class_name: str) -> set[str]:
    """Annotated fields (dataclass / msgspec style) and enum members of a class."""
    names = set()
    for node in find_class(module, class_name).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def module_constant(module: str, name: str):
    """The literal value assigned to a module-level name."""
    for node in parse(module).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module} assigns no constant {name}")


def server_args_fields() -> dict[str, bool]:
    """Every ServerArgs field of the installed SGLang -> whether it has a command-line flag.

    ServerArgs is assembled from the msgspec namespaces in sglang/srt/arg_groups/fields/*.py; a field annotated
    with Arg(no_cli=True) has no flag (its value can still be passed to sglang.Engine)."""
    fields = {}
    for path in sorted((sglang_root() / "srt" / "arg_groups" / "fields").glob("*.py")):
        module = "sglang.srt.arg_groups.fields." + path.stem
        for node in ast.walk(parse(module)):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                        and not item.target.id.startswith("_"):
                    no_cli = any(isinstance(k, ast.keyword) and k.arg == "no_cli"
                                 and isinstance(k.value, ast.Constant) and k.value.value is True
                                 for call in ast.walk(item.annotation) if isinstance(call, ast.Call)
                                 for k in call.keywords)
                    fields[item.target.id] = not no_cli
    return fields


def source_of(node: ast.AST) -> str:
    """The node's text exactly as written in the file (quotes and spacing included)."""
    text = _TEXT[node._sglang_module]
    return text if isinstance(node, ast.Module) else ast.get_source_segment(text, node)
