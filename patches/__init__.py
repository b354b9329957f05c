"""Run-time hooks into SGLang for stage 02's `--backend sglang` (never edits of SGLang's installed files). The SGLang
releases they are checked against, and how those differ: patches/sglang_releases.py. How SGLang imports them:
docs/extraction.md. No heavy imports here: SGLang imports this package in every process."""
from __future__ import annotations

SGLANG_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"


def installed_sglang_version() -> str | None:
    """The installed SGLang distribution's version, read from its metadata (nothing is imported)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None
