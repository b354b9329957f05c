"""Run-time hooks into SGLang for stage 02's `--backend sglang` (never edits of SGLang's installed files), and the
one pinned SGLang release they are written for. How SGLang imports them: docs/extraction.md. No heavy imports
here: SGLang imports this package in every process."""
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
