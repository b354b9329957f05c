"""A fingerprint of the verifier's weights that is cheap to recompute: two fine-tunes of one model share config and
tokenizer, so only the weights tell them apart, and a drafter must learn the verifier it will serve.

Reading every byte of a 1 TB checkpoint is not cheap; the fingerprint hashes each weight file's name and size,
its first MiB (a safetensors file's header: tensor names, dtypes, shapes, offsets) and SAMPLES evenly spaced
blocks of its data. A fine-tune changes nearly every byte of the tensors it trains, so it changes sampled blocks
unless it touched almost none of the file (then it is nearly the same verifier).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from common.cli.errors import UsageError
from common.verifier.loading import resolve_model_path

METHOD = "sampled-sha256-v1"
SAMPLES = 64
BLOCK = 64 * 1024
HEAD = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_path: str) -> list[Path]:
    """The files that hold the verifier's weights (empty for a hub name not downloaded here)."""
    folder, gguf_file = resolve_model_path(model_path)
    if gguf_file is not None:
        return [Path(folder, gguf_file)]
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == INDEX_FILE))


def _hash_file(digest, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(HEAD))
        span = max(0, size - HEAD - BLOCK)  # where the sampled blocks may start, after the head
        for k in range(SAMPLES if size > HEAD else 0):
            handle.seek(HEAD + span * k // (SAMPLES - 1))
            digest.update(handle.read(BLOCK))


def weights_fingerprint(model_path: str) -> dict | None:
    """{"method", "sha256", "files", "bytes"} of the verifier's weight files, or None when there are none here."""
    files = weight_files(model_path)
    if not files:
        return None
    digest = hashlib.sha256()
    try:
        for path in files:
            _hash_file(digest, path)
    except OSError as err:
        raise UsageError(f"--model-path {model_path}: cannot read its weights ({err})")
    return {"method": METHOD, "sha256": digest.hexdigest(), "files": len(files),
            "bytes": sum(os.path.getsize(p) for p in files)}


def check_same_weights(recorded: dict | None, recorded_model: str, model_path: str, allow_other: bool, where: str,
                       log) -> None:
    """Refuse (exit 2) a --model-path whose weights differ from those `where` was made with, naming both."""
    if not recorded or recorded.get("method") != METHOD:
        log.warning("%s records no fingerprint of its verifier's weights (made before they were recorded): cannot "
                    "tell whether --model-path %s has the same weights as %s", where, model_path, recorded_model)
        return
    current = weights_fingerprint(model_path)
    if current is None:
        log.warning("--model-path %s: no weight files here to compare with those of %s", model_path, where)
        return
    if current["sha256"] == recorded["sha256"]:
        return
    message = (f"--model-path {model_path} has other weights than the verifier {recorded_model} that {where} was "
               f"made with (same config and tokenizer; weights fingerprint {current['sha256'][:16]}..., "
               f"{current['bytes']} bytes in {current['files']} files, against {recorded['sha256'][:16]}..., "
               f"{recorded['bytes']} bytes in {recorded['files']} files). A drafter must learn the verifier it "
               f"serves: use {recorded_model}, or pass --allow-other-verifier to go on anyway")
    if not allow_other:
        raise UsageError(message)
    log.warning("%s (continuing: --allow-other-verifier)", message)
