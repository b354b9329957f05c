"""The SGLang engine settings a user chooses (attention and sampling backends, any other server argument), in one
form for both places that start SGLang: stage 02's extraction engine (keyword arguments of sglang.Engine) and the
serving command scripts/sglang_launch_command.py prints (`--flag value` arguments).

Names are SGLang's ServerArgs fields. The set differs between releases (0.5.17 declares them all in ServerArgs,
0.5.23 in field groups under sglang/srt/arg_groups/; some exist in one release only), so a name is checked against
the installed release's own source, read as text: nothing of SGLang is imported, and the check runs in a second,
before any verifier loads.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from eagle3_pipeline.errors import UsageError

# Server arguments stage 02 sets from its own flags: a --sglang-arg may not set them a second way.
FROM_STAGE_FLAGS = {"model_path": "--model-path", "tp_size": "--tp-size", "dtype": "--dtype",
                    "trust_remote_code": "--trust-remote-code", "mem_fraction_static": "--gpu-memory-utilization",
                    "max_running_requests": "--batch-size", "max_prefill_tokens": "--max-tokens-per-batch",
                    "attention_backend": "--attention-backend", "sampling_backend": "--sampling-backend"}


def parse_sglang_args(pairs: Sequence[str] | None) -> dict[str, Any]:
    """`--sglang-arg KEY=VALUE` pairs as {server_arg: value}: dashes in KEY become underscores, VALUE is read as JSON
    when it parses (true, 8, 0.5, "x", [1, 2]) and as text otherwise."""
    settings: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, text = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise UsageError(f"--sglang-arg {pair!r}: expected KEY=VALUE, e.g. --sglang-arg disable_cuda_graph=true")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if key in settings and settings[key] != value:
            raise UsageError(f"--sglang-arg sets {key} twice ({settings[key]!r} and {value!r}); give it once")
        settings[key] = value
    return settings


def chosen_settings(pairs: Sequence[str] | None, attention_backend: str | None = None,
                    sampling_backend: str | None = None) -> dict[str, Any]:
    """The engine settings stage 02's --sglang-arg pairs, --attention-backend and --sampling-backend choose (unset
    ones left to SGLang's defaults for the GPU it runs on)."""
    settings = parse_sglang_args(pairs)
    for key, flag in FROM_STAGE_FLAGS.items():
        if key in settings:
            raise UsageError(f"--sglang-arg {key}=...: set it with {flag}")
    for key, value in (("attention_backend", attention_backend), ("sampling_backend", sampling_backend)):
        if value:
            settings[key] = value
    return settings


def installed_sglang_root() -> Path | None:
    """The installed sglang package folder, found without importing it (None when SGLang is absent)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _annotated_names(path: Path, class_name: str | None) -> set[str]:
    """The annotated class attributes (dataclass-style fields) of `class_name` in a file, or of all its classes."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {item.target.id for node in tree.body if isinstance(node, ast.ClassDef)
            and class_name in (None, node.name) for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            and not item.target.id.startswith("_")}


def server_arg_names(sglang_root: Path) -> set[str]:
    """The server argument names of a release: ServerArgs' fields in srt/server_args.py (0.5.17 declares them
    there) and the field namespaces in srt/arg_groups/fields/ (0.5.23 assembles ServerArgs from those)."""
    server_args = sglang_root / "srt" / "server_args.py"
    if not server_args.is_file():
        raise UsageError(f"{server_args} is missing: is SGLang installed whole?")
    names = _annotated_names(server_args, "ServerArgs")
    for path in sorted((sglang_root / "srt" / "arg_groups" / "fields").glob("*.py")):
        names |= _annotated_names(path, None)
    return names


def check_setting_names(settings: Iterable[str], known: set[str], release: str, reserved: dict[str, str]) -> None:
    """Every chosen setting is a server argument of this release and not one the caller fixes itself (`reserved`:
    name -> what to do instead). Raises UsageError naming the setting, the closest names, and the fix."""
    for name in settings:
        if name in reserved:
            raise UsageError(f"--sglang-arg {name}: {reserved[name]}")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise UsageError(f"SGLang {release} has no server argument {name!r}{hint} (its names: "
                             f"python -m sglang.launch_server --help, with dashes for underscores)")


def as_launch_arguments(settings: dict[str, Any]) -> list[str]:
    """The settings as `python -m sglang.launch_server` arguments: true -> a bare switch, false -> left out (SGLang's
    switches are off by default), a list -> its items after the flag, anything else -> its text."""
    argv: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *(str(item) for item in value)]
        else:
            argv += [flag, value if isinstance(value, str) else json.dumps(value)]
    return argv
