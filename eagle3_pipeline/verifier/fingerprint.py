"""A fingerprint of the verifier's weights that is cheap to recompute: two fine-tunes of one model share config and
tokenizer, so only the weights tell them apart, and a drafter must learn the verifier it will serve.

Two parts, both independent of tensor names and of how the weights are split into files (a re-saved or
re-nested copy of the same weights has the same fingerprint):
- "embeddings": embed_tokens and lm_head (what stage 04 trains with), SAMPLES blocks of each;
- "tensors": every tensor of the safetensors files, as dtype, shape and one block from its middle. A fine-tune
  changes nearly every value of each tensor it trains, so one block per tensor sees it, at one read per tensor.
A part that cannot be computed here (a hub name, .bin or GGUF weights, an unreadable file) is None and not compared.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.verifier.loading import locate_embedding_tensors, resolve_model_path

METHOD = "tensor-samples-sha256-v1"
SAMPLES = 64  # blocks of embed_tokens and lm_head
BLOCK = 4096


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > 100 * 2 ** 20:
            raise ValueError(f"{path}: not a safetensors file")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def tensor_digest(fd: int, data_start: int, meta: dict, samples: int) -> bytes:
    """dtype, shape and `samples` evenly spaced blocks of one tensor's bytes (one block: from its middle)."""
    begin, end = (data_start + offset for offset in meta["data_offsets"])
    digest = hashlib.sha256(f"{meta['dtype']}{meta['shape']}".encode())
    span = max(0, end - begin - BLOCK)
    starts = [begin + span // 2] if samples == 1 else [begin + span * k // (samples - 1) for k in range(samples)]
    for start in starts:
        digest.update(os.pread(fd, min(BLOCK, end - start), start))
    return digest.digest()


def _digest_files(files: dict[Path, list[str] | None], samples: int) -> list[bytes]:
    """Digests of the named tensors of each file (None: all its tensors)."""
    digests = []
    for path, names in files.items():
        header, data_start = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            in_file_order = sorted(names or header, key=lambda name: header[name]["data_offsets"][0])  # forward reads
            digests += [tensor_digest(fd, data_start, header[name], samples) for name in in_file_order]
        finally:
            os.close(fd)
    return digests


def embeddings_part(model_path: str) -> str | None:
    folder, gguf_file = resolve_model_path(model_path)
    if gguf_file is not None or not Path(folder).is_dir():
        return None
    try:
        located = locate_embedding_tensors(model_path)
        digests = [_digest_files({Path(folder) / shard: [name]}, SAMPLES)[0] for name, shard in located.values()]
    except (UsageError, OSError, ValueError, KeyError):
        return None
    return hashlib.sha256(b"".join(digests)).hexdigest()


def tensors_part(model_path: str) -> tuple[str | None, int]:
    folder, gguf_file = resolve_model_path(model_path)
    files = sorted(Path(folder).glob("*.safetensors")) if gguf_file is None and Path(folder).is_dir() else []
    if not files:
        return None, 0
    try:
        digests = sorted(_digest_files({path: None for path in files}, 1))
    except (OSError, ValueError, KeyError):
        return None, 0
    return hashlib.sha256(b"".join(digests)).hexdigest(), len(digests)


def weights_fingerprint(model_path: str) -> dict | None:
    """{"method", "embeddings", "tensors", "tensor_count"} of the verifier's weights; None when neither part can
    be computed here."""
    embeddings = embeddings_part(model_path)
    tensors, count = tensors_part(model_path)
    if embeddings is None and tensors is None:
        return None
    return {"method": METHOD, "embeddings": embeddings, "tensors": tensors, "tensor_count": count}


def differing_parts(recorded: dict, current: dict) -> list[str]:
    """The parts computed on both sides that differ."""
    names = {"embeddings": "embed_tokens/lm_head", "tensors": "the tensors"}
    return [label for key, label in names.items()
            if recorded.get(key) and current.get(key) and recorded[key] != current[key]]


def check_same_weights(recorded: dict | None, recorded_model: str, model_path: str, allow_other: bool, where: str,
                       log) -> None:
    """Refuse (exit 2) a --model-path whose weights differ from those `where` was made with, naming both."""
    if not recorded or recorded.get("method") != METHOD:
        log.warning("%s records no fingerprint of its verifier's weights (made before they were recorded): cannot "
                    "tell whether --model-path %s has the same weights as %s", where, model_path, recorded_model)
        return
    current = weights_fingerprint(model_path) or {}
    differing = differing_parts(recorded, current)
    if not differing:
        if not any(recorded.get(k) and current.get(k) for k in ("embeddings", "tensors")):
            log.warning("--model-path %s: its weights cannot be compared with those of %s here", model_path, where)
        return
    message = (f"--model-path {model_path} has other weights than the verifier {recorded_model} that {where} was "
               f"made with: {' and '.join(differing)} differ (the config and tokenizer are the same). A drafter "
               f"must learn the verifier it serves: use {recorded_model}, or pass --allow-other-verifier to go on "
               f"anyway")
    if not allow_other:
        raise UsageError(message)
    log.warning("%s (continuing: --allow-other-verifier)", message)
