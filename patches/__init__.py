"""Run-time hooks into SGLang for stage 02's `--backend sglang` (never edits of SGLang's installed files).

The hooks are written against ONE SGLang release, pinned here and nowhere else: requirements-test.txt names
the same version (the tests read that release's source), and stage 02 refuses any other installed version
before it starts the engine, because the hooks rely on SGLang internals (the text models' `layers_to_capture`
and forward signatures, ForwardBatch fields) that change between releases.

How SGLang picks the hooks up: the engine runs the model in its own scheduler processes (one per TP rank,
started with multiprocessing "spawn"), so a patch applied in the stage's process would not reach them. SGLang
imports every module of the package named by the environment variable SGLANG_EXTERNAL_MODEL_PACKAGE in each of
those processes (sglang/srt/models/registry.py, meant for out-of-tree model classes); stage 02 names this
package there, and `patches.sglang_capture` installs the hooks when it is imported with a capture plan in the
environment. This module stays free of heavy imports, since SGLang imports it in every process.
"""
from __future__ import annotations

SUPPORTED_SGLANG_VERSION = "0.5.23"
SGLANG_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"


def installed_sglang_version() -> str | None:
    """The installed SGLang distribution's version, read from its metadata (nothing is imported)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def sglang_version_problem(installed: str | None) -> str | None:
    """Why the installed SGLang cannot be used with these hooks (None when it can)."""
    install = f"pip install sglang=={SUPPORTED_SGLANG_VERSION}"
    if installed is None:
        return (f"SGLang is not installed; --backend sglang needs sglang=={SUPPORTED_SGLANG_VERSION} "
                f"({install} on the GPU machine), or use --backend hf")
    if installed != SUPPORTED_SGLANG_VERSION:
        return (f"SGLang {installed} is installed, but the capture hooks in patches/ are written for "
                f"sglang=={SUPPORTED_SGLANG_VERSION} (they use its internal model classes); {install}, or use "
                f"--backend hf")
    return None
