"""Stage 02's engine: run the verifier over tokenized samples and store what EAGLE-3 trains on.

Layout of the output folder (the hidden-states "data dir" that stage 04 reads):

    manifest.json                 layers + their convention, hidden size, dtype, verifier identity, counts
    index.jsonl                   {"id", "path", "num_tokens", "loss_tokens"} per complete sample, data order
    shard_00000/<sample>/         samples 0..999 of the prepared data (never more than 1000 per folder)
        aux_0.pt aux_1.pt aux_2.pt  [S, H]  residual stream ENTERING decoder layers l_0 < l_1 < l_2, which is
                                            transformers' output_hidden_states[l_k] (un-normalised)
        final.pt                    [S, H]  last hidden state after the final norm: lm_head(final) = logits
        meta.pt                     {"input_ids": int64 [S], "loss_mask": uint8 [S]}

A sample is written into `.tmp_<name>_<pid>/` and renamed into place when all five files are complete, so a
sample folder that exists is a complete sample; a rerun skips those and redoes everything else.

Why the pipeline looks the way it does (the GPU must never wait for the disk):
  * samples are sorted by length and batched (`plan_batches`), right-padded, and run through the verifier's
    base model only (no LM head: logits over a 160K vocabulary would cost more than the rest);
  * forward pre-hooks on the three decoder layers take their inputs; the base model's output is `final`.
    Only the real (unpadded) tokens are gathered, on the GPU, in the stored dtype;
  * a side CUDA stream copies them into page-locked staging buffers while the next batch computes;
  * writer PROCESSES save the files. Threads were measured first: torch.save spends ~0.3-0.5 ms per file in
    Python, and writer threads holding the GIL starved the thread that launches the GPU kernels (its op rate
    fell to 3-14% while two writers saved small files). Processes share the staging buffers through an
    anonymous shared mapping created before they are forked, so only (sample, buffer, offset) crosses over;
  * a ring of staging buffers bounds host memory; when all are in use the GPU loop waits (the disk is then
    the limit, and nothing else could help).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import queue
import re
import shutil
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from common.batching import pack_by_length
from common.formats.manifest import MANIFEST, load_manifest
from common.formats.files import write_text_atomic
from common.cli.errors import UsageError
from common.verifier.loading import inference_attention

STAGE = "02_extract_hidden_states"
FORMAT_VERSION = 1
SHARD_SIZE = 1000
INDEX_FILE = "index.jsonl"
LOCK_FILE = ".lock"
AUX_FILES = ("aux_0.pt", "aux_1.pt", "aux_2.pt")
FINAL_FILE = "final.pt"
META_FILE = "meta.pt"
SAMPLE_FILES = AUX_FILES + (FINAL_FILE, META_FILE)
LAYER_CONVENTION = "hf_output_hidden_states_index (input of decoder layer)"
FINAL_CONVENTION = "last hidden state after the final norm (lm_head(final) == logits)"
TMP_PREFIX = ".tmp_"
PAD_TOKEN_ID = 0  # right padding under a causal mask is never attended to, so any valid id works
STAGING_BUFFERS = 3  # one being filled by the GPU, up to two being written
# Test-only: kill this process (SIGKILL, like the OOM killer) once this many samples are written, to prove
# that a rerun after a hard crash gives the same files as an uninterrupted run.
CRASH_ENV = "EAGLE3_TEST_CRASH_AFTER_SAMPLES"

# torch.save's per-record CRC32 runs at ~1.5 GB/s on one core and torch.load never checks it.
try:
    import torch.utils.serialization as _torch_serialization

    _SAVE_CONFIG = _torch_serialization.config.save
except (ImportError, AttributeError):  # older torch: keep its default
    _SAVE_CONFIG = None


def log() -> logging.Logger:
    return logging.getLogger("eagle3")


# --- samples -----------------------------------------------------------------------------------------

@dataclass
class Sample:
    """One tokenized conversation of the prepared data, at `position` (0-based line order) in its file."""
    position: int
    id: str
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # uint8 [S]
    truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def rel_path(self) -> str:
        return f"{shard_name(self.position)}/{sample_dir_name(self.id)}"


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def shard_name(position: int) -> str:
    return f"shard_{position // SHARD_SIZE:05d}"


def sample_dir_name(sample_id: str) -> str:
    """A file-system-safe folder name for a sample id (ids with other characters get a hash suffix)."""
    safe = _UNSAFE.sub("_", sample_id)[:80]
    if safe == sample_id and safe and not safe.startswith("."):
        return safe
    digest = hashlib.sha1(sample_id.encode()).hexdigest()[:10]
    return f"{safe.lstrip('.') or 'sample'}-{digest}"


def read_prepared_data(path: str | os.PathLike, vocab_size: int,
                       max_seq_len: int) -> tuple[list[Sample], dict[str, int]]:
    """Parse and check stage 01's JSONL; a bad line stops the stage naming the file, line and fix.

    Returns the samples (cut to max_seq_len) and the file's counts as written (samples, tokens, loss_tokens),
    which stage 01's manifest must match.
    """
    path = Path(path)
    samples: list[Sample] = []
    counts = {"samples": 0, "tokens": 0, "loss_tokens": 0}
    first_line_of: dict[str, int] = {}
    fix = "rerun 01_prepare_data.py (or point --prepared-data at its output)"
    with open(path) as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{where}: not valid JSON ({err}); {fix}")
            if not isinstance(record, dict) or not {"id", "input_ids", "loss_mask"} <= record.keys():
                raise UsageError(f"{where}: needs the keys id, input_ids, loss_mask; {fix}")
            sample_id, ids, mask = record["id"], record["input_ids"], record["loss_mask"]
            if isinstance(sample_id, int) and not isinstance(sample_id, bool):
                sample_id = str(sample_id)
            if not isinstance(sample_id, str) or not sample_id:
                raise UsageError(f"{where}: id must be a non-empty string; {fix}")
            if sample_id in first_line_of:
                raise UsageError(f"{where}: id {sample_id!r} repeats line {first_line_of[sample_id]}; ids must be "
                                 f"unique; {fix}")
            first_line_of[sample_id] = line_no
            if not isinstance(ids, list) or not isinstance(mask, list) or not ids or len(ids) != len(mask):
                raise UsageError(f"{where}: input_ids and loss_mask must be non-empty lists of the same length "
                                 f"(got {len(ids) if isinstance(ids, list) else type(ids).__name__} and "
                                 f"{len(mask) if isinstance(mask, list) else type(mask).__name__}); {fix}")
            try:
                ids_t = torch.tensor(ids, dtype=torch.int64)
                mask_t = torch.tensor(mask, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError) as err:
                raise UsageError(f"{where}: input_ids and loss_mask must hold integers ({err}); {fix}")
            if ids_t.ndim != 1 or int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab_size:
                raise UsageError(f"{where}: token ids must lie in 0..{vocab_size - 1} (the verifier's vocabulary); "
                                 f"got {int(ids_t.min())}..{int(ids_t.max())}. Was the data tokenized for another "
                                 f"model? {fix}")
            if mask_t.ndim != 1 or not bool(((mask_t == 0) | (mask_t == 1)).all()):
                raise UsageError(f"{where}: loss_mask must hold only 0 and 1; {fix}")
            counts["samples"] += 1
            counts["tokens"] += int(ids_t.numel())
            counts["loss_tokens"] += int(mask_t.sum())
            truncated = ids_t.numel() > max_seq_len
            samples.append(Sample(position=len(samples), id=sample_id, input_ids=ids_t[:max_seq_len].clone(),
                                  loss_mask=mask_t[:max_seq_len].to(torch.uint8), truncated=truncated))
    if not samples:
        raise UsageError(f"{path}: no samples; {fix}")
    return samples, counts


# --- batching ----------------------------------------------------------------------------------------

def plan_batches(samples: Sequence[Sample], batch_size: int, max_tokens_per_batch: int) -> list[list[int]]:
    """Indices into `samples`, grouped by similar length, longest first (an OOM shows up in the first batch).

    A batch holds at most `batch_size` sequences and at most `max_tokens_per_batch` padded tokens
    (sequences x longest); a single sequence longer than that gets a batch alone. The plan depends only on the
    data and these two numbers, so a rerun with the same flags recomputes the very same batches.
    """
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, samples[i].position))
    return pack_by_length(order, [sample.num_tokens for sample in samples], max_tokens_per_batch, batch_size)


def rank_batches(samples: Sequence[Sample], batches: Sequence[list[int]], world_size: int,
                 rank: int) -> list[list[int]]:
    """The batches one rank of a torchrun extraction runs: a disjoint share of `batches` (the remaining ones of
    the single-process plan), balanced by padded tokens, in plan order.

    Splitting whole batches of the one plan, rather than samples, keeps every sample in the batch it would
    have had in a single process, so the files are bit-identical whatever the number of ranks, and a resume
    with another number of ranks simply shares out what is left.
    """
    from common.cli.distributed import share_by_cost

    costs = [len(batch) * max(samples[i].num_tokens for i in batch) for batch in batches]
    return [batches[i] for i in share_by_cost(costs, world_size)[rank]]


def padding_stats(samples: Sequence[Sample], batches: Iterable[list[int]]) -> dict[str, float]:
    real = padded = 0
    for batch in batches:
        lengths = [samples[i].num_tokens for i in batch]
        real += sum(lengths)
        padded += max(lengths) * len(lengths)
    return {"real_tokens": real, "padded_tokens": padded,
            "padding_waste": round(1.0 - real / padded, 4) if padded else 0.0}


# --- finding the text model inside a Hugging Face model ----------------------------------------------

_LAYER_LISTS = ("layers", "h", "blocks", "block")
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")
_NOT_TEXT = ("vision", "visual", "audio", "image", "mm_projector", "multi_modal_projector", "speech")


@dataclass
class TextModel:
    """The parts of a verifier that extraction uses: the base model (embeddings -> layers -> final norm)."""
    base: torch.nn.Module
    layers: torch.nn.ModuleList
    name: str
    lm_head: torch.nn.Module | None

    @property
    def input_device(self) -> torch.device:
        embeddings = self.base.get_input_embeddings() if hasattr(self.base, "get_input_embeddings") else None
        if embeddings is not None and getattr(embeddings, "weight", None) is not None:
            return embeddings.weight.device
        return next(self.base.parameters()).device


def find_text_model(model: torch.nn.Module, num_layers: int | None = None) -> TextModel:
    """Locate the decoder stack of any causal LM, including multimodal wrappers.

    Looks for the sub-module that owns both a list of decoder layers and a final norm (model.model for
    Llama/DeepSeek-V3, model.model.language_model for transformers' own multimodal classes,
    model.language_model.model for Kimi-K2.5's remote code, transformer for GPT-2 style), skipping vision
    and audio towers; with `num_layers`, the list must have that many layers.
    """
    candidates = []
    for name, module in model.named_modules():
        if any(word in name.lower() for word in _NOT_TEXT):
            continue
        layers = next((getattr(module, a) for a in _LAYER_LISTS
                       if isinstance(getattr(module, a, None), torch.nn.ModuleList)), None)
        has_norm = any(isinstance(getattr(module, a, None), torch.nn.Module) for a in _FINAL_NORMS)
        if layers is None or not has_norm or len(layers) == 0:
            continue
        if num_layers is not None and len(layers) != num_layers:
            continue
        candidates.append((name.count("."), len(name), name, module, layers))
    if not candidates:
        raise RuntimeError(f"{type(model).__name__}: found no sub-module with a list of "
                           f"{num_layers or 'any number of'} decoder layers and a final norm; this architecture "
                           f"is not supported by the hf backend")
    _, _, name, base, layers = min(candidates, key=lambda c: c[:3])
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm_head is None:
        lm_head = getattr(model, "lm_head", None)
    return TextModel(base=base, layers=layers, name=name or "<root>", lm_head=lm_head)


def run_base(text: TextModel, input_ids: torch.Tensor) -> torch.Tensor:
    """One forward of the base model (no LM head, no KV cache); returns the post-norm last hidden state."""
    out = text.base(input_ids=input_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


class LayerInputCapture:
    """Forward pre-hooks that keep the real tokens of the residual stream entering chosen decoder layers.

    The input of layer l is exactly transformers' output_hidden_states[l] (index 0 = embedding output), and
    a pre-hook sees it without keeping the other L+1 states alive. The gather happens inside the hook, so a
    later in-place change of the residual stream could not leak into what is stored.
    """

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: Sequence[int]):
        self.layer_ids = list(layer_ids)
        self.captured: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        self._select = None
        self._handles = [layers[layer].register_forward_pre_hook(self._hook(k), with_kwargs=True)
                         for k, layer in enumerate(self.layer_ids)]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            if self._select is not None:
                hidden = args[0] if args else kwargs.get("hidden_states")
                if not torch.is_tensor(hidden):
                    raise RuntimeError(f"{type(module).__name__} (decoder layer {self.layer_ids[k]}) was called "
                                       f"without its hidden states as first argument or hidden_states=")
                self.captured[k] = self._select(hidden)
        return hook

    def arm(self, select) -> None:
        self.captured = [None] * len(self.layer_ids)
        self._select = select

    def take(self) -> list[torch.Tensor]:
        self._select = None
        missing = [layer for layer, t in zip(self.layer_ids, self.captured) if t is None]
        if missing:
            raise RuntimeError(f"decoder layer(s) {missing} were not called during the forward pass")
        out, self.captured = self.captured, [None] * len(self.layer_ids)
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class TokenSelector:
    """Gathers the real (unpadded) tokens of a [B, S, H] batch into [N, H] in the stored dtype, per device."""

    def __init__(self, flat_index_cpu: torch.Tensor, store_dtype: torch.dtype):
        self.index_cpu = flat_index_cpu
        self.store_dtype = store_dtype
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        index = self._on.get(hidden.device)
        if index is None:
            index = self.index_cpu.to(hidden.device, non_blocking=True)
            self._on[hidden.device] = index
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index).to(self.store_dtype)


def sample_states(text: TextModel, aux_layers: Sequence[int], input_ids: Sequence[int],
                  loss_from: int) -> dict[str, torch.Tensor]:
    """What this stage would store for one token sequence, as a batch of one for stage 04's validation, on
    the CPU (a caller may keep many): aux [1, S, 3H] (inputs of `aux_layers`), final [1, S, H], input_ids
    and a loss mask set from position `loss_from` on. Stage 05 uses it to score a drafter teacher-forced on
    the text it just decoded, through the same capture and forward as extraction."""
    capture = LayerInputCapture(text.layers, aux_layers)
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=text.input_device)
    try:
        with torch.inference_mode(), inference_attention():
            capture.arm(lambda hidden: hidden)
            final = run_base(text, ids)
            aux = torch.cat(capture.take(), dim=-1)
    finally:
        capture.remove()
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, loss_from:] = 1
    return {"input_ids": ids.cpu(), "loss_mask": loss_mask.cpu(), "aux": aux.cpu(), "final": final.cpu()}


def batch_inputs(samples: Sequence[Sample], batch: Sequence[int], pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, S] and the flat positions of the real tokens, in batch order."""
    lengths = [samples[i].num_tokens for i in batch]
    width = max(lengths)
    ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.int64)
    for row, index in enumerate(batch):
        ids[row, :lengths[row]] = samples[index].input_ids
    flat = torch.cat([torch.arange(n) + row * width for row, n in enumerate(lengths)])
    if pin:
        ids, flat = ids.pin_memory(), flat.pin_memory()
    return ids, flat


# --- the output folder ------------------------------------------------------------------------------

def is_complete_sample(folder: Path) -> bool:
    """All five files present and non-empty (files are not fsynced: after a power loss a renamed folder could
    hold empty files, which makes the sample incomplete and redone)."""
    try:
        with os.scandir(folder) as entries:
            sizes = {entry.name: entry.stat().st_size for entry in entries}
    except OSError:
        return False
    return all(sizes.get(name, 0) > 0 for name in SAMPLE_FILES)


def scan_output(output_dir: Path, samples: Sequence[Sample], clean: bool = True) -> set[int]:
    """Indices of samples already complete on disk; with `clean`, remove temp folders and incomplete samples."""
    complete: set[int] = set()
    by_shard: dict[str, dict[str, int]] = {}
    for index, sample in enumerate(samples):
        shard, name = sample.rel_path.split("/")
        by_shard.setdefault(shard, {})[name] = index
    for shard, names in by_shard.items():
        shard_dir = output_dir / shard
        if not shard_dir.is_dir():
            continue
        with os.scandir(shard_dir) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    if clean:
                        shutil.rmtree(entry.path, ignore_errors=True)
                    continue
                index = names.get(entry.name)
                if index is None or not entry.is_dir():
                    continue
                if is_complete_sample(Path(entry.path)):
                    complete.add(index)
                elif clean:
                    shutil.rmtree(entry.path, ignore_errors=True)
    return complete


def owned_entries(output_dir: Path) -> list[Path]:
    """What an earlier extraction wrote here (removed by --overwrite; nothing else in the folder is touched)."""
    if not output_dir.is_dir():
        return []
    owned = [p for p in output_dir.iterdir()
             if (p.is_dir() and re.fullmatch(r"shard_\d{5}", p.name)) or p.name in (INDEX_FILE, MANIFEST)]
    return sorted(owned)


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove_owned(output_dir: Path) -> int:
    entries = owned_entries(output_dir)
    for path in entries:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return len(entries)


class OutputLock:
    """An exclusive lock on the output folder, so two runs never write into the same samples."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / LOCK_FILE
        self.handle = None

    def __enter__(self) -> "OutputLock":
        self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            holder = self.handle.read().strip() or "unknown"
            self.handle.close()
            raise UsageError(f"{self.path.parent}: another extraction (pid {holder}) is writing here; wait for "
                             f"it or use another --output-dir")
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(str(os.getpid()))
        self.handle.flush()
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()


def check_writable(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write_test_{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--output-dir {output_dir} is not writable ({err}); choose a folder you can write")


# Per sample besides the tensors: five torch.save headers (~1.5 KB each), the unused tail of each file's last
# 4 KB block (2 KB on average), and one directory block.
_PER_FILE_OVERHEAD = 1536 + 2048
_PER_SAMPLE_OVERHEAD = len(SAMPLE_FILES) * _PER_FILE_OVERHEAD + 4096
_META_BYTES_PER_TOKEN = 8 + 1


def estimate_disk_bytes(num_tokens: int, num_samples: int, hidden_size: int, bytes_per_value: int) -> int:
    """Bytes the output will take: tokens x 4 tensors x hidden x bytes per value, plus metadata and overheads."""
    per_token = len(AUX_FILES + (FINAL_FILE,)) * hidden_size * bytes_per_value + _META_BYTES_PER_TOKEN
    return num_tokens * per_token + num_samples * _PER_SAMPLE_OVERHEAD


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1024 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PB"


def write_index(output_dir: Path, samples: Sequence[Sample], complete: Iterable[int]) -> list[dict]:
    entries = [{"id": samples[i].id, "path": samples[i].rel_path, "num_tokens": samples[i].num_tokens,
                "loss_tokens": int(samples[i].loss_mask.sum())} for i in sorted(complete)]
    write_text_atomic(output_dir / INDEX_FILE, "".join(json.dumps(e) + "\n" for e in entries))
    return entries


# --- writing one sample ------------------------------------------------------------------------------

def standalone(view: torch.Tensor) -> torch.Tensor:
    """A tensor over exactly the bytes of a contiguous view, without copying them.

    torch.save writes a tensor's whole storage: saving a slice of a staging buffer would write the buffer.
    Slicing the storage gives a storage of just those bytes (sharing memory), and torch.save writes that.
    """
    assert view.is_contiguous()
    size = view.element_size()
    start = view.storage_offset() * size
    storage = view.untyped_storage()[start:start + view.numel() * size]
    return torch.empty(0, dtype=view.dtype).set_(storage, 0, tuple(view.shape), tuple(view.stride()))


def _load_syncfs():
    """libc's syncfs (Linux): one call writes back and flushes a whole file system."""
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).syncfs
        function.argtypes = [ctypes.c_int]
        return function
    except (OSError, AttributeError):
        return None


_SYNCFS = _load_syncfs()


def flush_to_disk(folder: Path, files: Sequence[Path]) -> None:
    """Make `files` durable before the caller renames them into place.

    Two reasons. A rename can reach the disk before the data it names, so after a power loss a sample
    folder could hold empty files; syncing first rules that out. And it keeps the disk busy from the first
    sample: without it the kernel holds gigabytes of dirty pages and writes them late, so a run looks fast
    until the page cache fills and then stalls (the rate that matters is the sustained one).
    One syncfs per batch of samples rather than an fdatasync per file: each sync also flushes the disk's
    own cache, which on a virtual disk costs milliseconds, and was measured to cost 25% of the write rate
    with 600 KB files.
    """
    if _SYNCFS is not None:
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            if _SYNCFS(descriptor) == 0:
                return
        finally:
            os.close(descriptor)
    for path in files:  # no syncfs here: the portable, slower way
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())


def stage_sample(output_dir: Path, sample: Sample, tensors: Sequence[torch.Tensor]) -> tuple[Path, list[Path], int]:
    """Write aux_0..2, final and meta of one sample into its temporary folder: (folder, files, bytes)."""
    final_dir = output_dir / sample.rel_path
    tmp_dir = final_dir.parent / f"{TMP_PREFIX}{final_dir.name}_{os.getpid()}"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    files, written = [], 0
    for name, tensor in zip(AUX_FILES + (FINAL_FILE,), tensors):
        torch.save(standalone(tensor), tmp_dir / name)
        files.append(tmp_dir / name)
        written += tensor.numel() * tensor.element_size()
    torch.save({"input_ids": sample.input_ids, "loss_mask": sample.loss_mask}, tmp_dir / META_FILE)
    files.append(tmp_dir / META_FILE)
    return tmp_dir, files, written + sample.num_tokens * _META_BYTES_PER_TOKEN


def publish_sample(output_dir: Path, sample: Sample, tmp_dir: Path) -> None:
    """The rename that makes a sample count: before it, a crash leaves only a temporary folder."""
    os.replace(tmp_dir, output_dir / sample.rel_path)


def write_samples(output_dir: Path, samples: Sequence[Sample], tensors: Sequence[Sequence[torch.Tensor]]) -> int:
    """Write several samples durably and atomically; returns the bytes written."""
    staged = [stage_sample(output_dir, sample, views) for sample, views in zip(samples, tensors)]
    flush_to_disk(output_dir, [path for _, files, _ in staged for path in files])
    for sample, (tmp_dir, _, _) in zip(samples, staged):
        publish_sample(output_dir, sample, tmp_dir)
    return sum(written for _, _, written in staged)


def write_sample(output_dir: Path, sample: Sample, tensors: Sequence[torch.Tensor]) -> int:
    """Write one sample durably into a temp folder, then rename it into place."""
    return write_samples(output_dir, [sample], [tensors])


class StagingBuffers:
    """Host buffers [4, capacity, H] that batches are copied into and written from.

    They live in an anonymous shared mapping (inherited by the forked writer processes, no /dev/shm needed)
    and, on a GPU run, are page-locked with cudaHostRegister so device-to-host copies run asynchronously.
    """

    def __init__(self, count: int, capacity_tokens: int, hidden_size: int, dtype: torch.dtype):
        self.shape = (len(AUX_FILES) + 1, max(1, capacity_tokens), hidden_size)
        self.dtype = dtype
        nbytes = self.shape[0] * self.shape[1] * self.shape[2] * torch.empty(0, dtype=dtype).element_size()
        self.maps = [mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED) for _ in range(count)]
        self.nbytes = nbytes
        self.tensors = [self.view(m) for m in self.maps]
        self.registered: list[int] = []

    def view(self, mapping: mmap.mmap) -> torch.Tensor:
        return torch.frombuffer(mapping, dtype=torch.uint8).view(self.dtype).view(self.shape)

    def pin(self) -> bool:
        """Page-lock the buffers for asynchronous GPU copies; False (and a warning) when the driver refuses."""
        cudart = torch.cuda.cudart()
        for tensor in self.tensors:
            # Portable: page-locked for every GPU's context, as a sharded verifier copies from several.
            code = int(cudart.cudaHostRegister(tensor.data_ptr(), self.nbytes, 1))
            if code != 0:
                log().warning("could not page-lock the staging buffers (cudaHostRegister error %d): device-to-host "
                              "copies will be synchronous and slower", code)
                return False
            self.registered.append(tensor.data_ptr())
        return True

    def close(self) -> None:
        if self.registered:
            cudart = torch.cuda.cudart()
            for pointer in self.registered:
                cudart.cudaHostUnregister(pointer)
            self.registered = []


def _writer_process(output_dir: str, samples: Sequence[Sample], staging: StagingBuffers, tasks, results) -> None:
    """Body of one writer process: write the chunks of samples it is given, report each chunk, stop at None."""
    try:  # die with the parent (a killed stage must not leave writers behind)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent, which stops us
    if _SAVE_CONFIG is not None:
        _SAVE_CONFIG.compute_crc32 = False
    buffers = [staging.view(m) for m in staging.maps]
    folder = Path(output_dir)
    while True:
        task = tasks.get()
        if task is None:
            return
        buffer, chunk = task
        index = chunk[0][0]
        try:
            staging_rows = buffers[buffer]
            views = [[staging_rows[k, offset:offset + samples[i].num_tokens] for k in range(staging_rows.shape[0])]
                     for i, offset in chunk]
            written = write_samples(folder, [samples[i] for i, _ in chunk], views)
            results.put(("done", buffer, [index for index, _ in chunk], written))
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops the stage
            results.put(("error", buffer, index, traceback.format_exc()))
            return


# --- the pipeline -----------------------------------------------------------------------------------

@dataclass
class ExtractionStats:
    batches: int = 0
    samples_written: int = 0
    tokens_forwarded: int = 0  # real tokens of every batch run (including recomputed complete samples)
    padded_tokens: int = 0
    tokens_written: int = 0
    files_written: int = 0
    bytes_written: int = 0
    elapsed_s: float = 0.0
    forward_wait_s: float = 0.0  # time the GPU loop waited for a free staging buffer (= for the disk)
    # (includes the final drain, also reported alone as extra["drain_s"])
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        rate = self.tokens_written / self.elapsed_s if self.elapsed_s else 0.0
        return {"batches": self.batches, "samples_written": self.samples_written,
                "tokens_forwarded": self.tokens_forwarded, "tokens_written": self.tokens_written,
                "padded_tokens": self.padded_tokens,
                "padding_waste": round(1 - self.tokens_forwarded / self.padded_tokens, 4) if self.padded_tokens else 0,
                "files_written": self.files_written, "bytes_written": self.bytes_written,
                "elapsed_s": round(self.elapsed_s, 3), "tokens_per_s": round(rate, 1),
                "write_bytes_per_s": round(self.bytes_written / self.elapsed_s, 1) if self.elapsed_s else 0.0,
                "waited_for_writers_s": round(self.forward_wait_s, 3), **self.extra}


def merge_rank_stats(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary of the ranks of a torchrun extraction (each an ExtractionStats.as_dict()): counts summed,
    rates over the slowest rank's time (the ranks run side by side), and each rank's own summary."""
    summed = ("batches", "samples_written", "tokens_forwarded", "tokens_written", "padded_tokens", "files_written",
              "bytes_written")
    merged: dict[str, Any] = {key: sum(s[key] for s in summaries) for key in summed}
    elapsed = max(s["elapsed_s"] for s in summaries)
    merged.update({
        "padding_waste": round(1 - merged["tokens_forwarded"] / merged["padded_tokens"], 4)
        if merged["padded_tokens"] else 0,
        "elapsed_s": elapsed,
        "tokens_per_s": round(merged["tokens_written"] / elapsed, 1) if elapsed else 0.0,
        "write_bytes_per_s": round(merged["bytes_written"] / elapsed, 1) if elapsed else 0.0,
        "waited_for_writers_s": max(s["waited_for_writers_s"] for s in summaries),
        "world_size": len(summaries),
        "ranks": list(summaries),
    })
    return merged


class Extractor:
    """Runs planned batches through a verifier's text model and writes every sample not yet complete.

    Create it BEFORE loading the model: it forks the writer processes, which should not inherit a CUDA
    context or a model. `num_workers` = 0 writes in the calling thread (no overlap; simplest to debug).
    The stage and scripts/bench_extraction.py both call `run`, so the benchmark measures this code.
    """

    def __init__(self, output_dir: str | os.PathLike, samples: Sequence[Sample], batches: Sequence[list[int]],
                 aux_layers: Sequence[int], hidden_size: int, store_dtype: torch.dtype, num_workers: int,
                 staging_buffers: int = STAGING_BUFFERS):
        self.output_dir = Path(output_dir)
        self.samples = samples
        self.aux_layers = list(aux_layers)
        self.hidden_size = hidden_size
        self.store_dtype = store_dtype
        capacity = max((sum(samples[i].num_tokens for i in batch) for batch in batches), default=1)
        self.staging = StagingBuffers(staging_buffers, capacity, hidden_size, store_dtype)
        self.num_workers = num_workers
        self.crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
        self._saved_crc = _SAVE_CONFIG.compute_crc32 if _SAVE_CONFIG is not None else None
        if _SAVE_CONFIG is not None:
            _SAVE_CONFIG.compute_crc32 = False
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(staging_buffers):
            self._free.put(index)
        self._lock = threading.Lock()
        self._outstanding = [0] * staging_buffers
        self._error: str | None = None
        self._written = 0
        self._done: set[int] = set()  # samples written by this Extractor
        self._stats = ExtractionStats()
        self._processes = []
        self._threads: list[threading.Thread] = []
        self._jobs: queue.Queue = queue.Queue()
        if num_workers > 0:
            import multiprocessing

            context = multiprocessing.get_context("fork")
            self._tasks = context.Queue()
            self._results = context.Queue()
            for _ in range(num_workers):
                process = context.Process(target=_writer_process, daemon=True,
                                          args=(str(self.output_dir), samples, self.staging, self._tasks,
                                                self._results))
                process.start()
                self._processes.append(process)
            for target in (self._dispatch_loop, self._collect_loop):
                thread = threading.Thread(target=target, daemon=True, name=f"extract-{target.__name__}")
                thread.start()
                self._threads.append(thread)
        self._copy_streams: dict[torch.device, Any] = {}
        self._pinned = False

    # -- lifecycle --
    def __enter__(self) -> "Extractor":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(abort=exc_type is not None)

    def close(self, abort: bool = False) -> None:
        if self._processes:
            if not abort:
                for _ in self._processes:
                    self._tasks.put(None)
                for process in self._processes:
                    process.join(timeout=60)
            for process in self._processes:
                if process.is_alive():
                    process.kill()
                    process.join()
            self._jobs.put(None)
            self._tasks.cancel_join_thread()
            self._results.put(None)
            for thread in self._threads:
                thread.join(timeout=10)
            self._processes = []
        self.staging.close()
        if _SAVE_CONFIG is not None and self._saved_crc is not None:
            _SAVE_CONFIG.compute_crc32 = self._saved_crc

    # -- background side (parent process) --
    def _fail(self, message: str) -> None:
        with self._lock:
            if self._error is None:
                self._error = message

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing hidden states failed:\n{self._error}")

    def _samples_written(self, indices: list[int], written_bytes: int) -> None:
        with self._lock:
            self._stats.samples_written += len(indices)
            self._stats.files_written += len(indices) * len(SAMPLE_FILES)
            self._stats.bytes_written += written_bytes
            self._written += len(indices)
            self._done.update(indices)
            done = self._written
        if self.crash_after and done >= self.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def _release(self, buffer: int) -> None:
        with self._lock:
            self._outstanding[buffer] -= 1
            free = self._outstanding[buffer] == 0
        if free:
            self._free.put(buffer)

    def _dispatch_loop(self) -> None:
        """Wait until a batch's device-to-host copies are done, then hand its samples to the writers."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            buffer, events, keep_alive, writes = job
            try:
                for event in events:
                    event.synchronize()
            except BaseException:  # noqa: BLE001
                self._fail(traceback.format_exc())
                return
            del keep_alive
            # One message per writer rather than per sample: fewer hand-offs through the parent's GIL.
            chunks = [writes[i::self.num_workers] for i in range(self.num_workers) if writes[i::self.num_workers]]
            with self._lock:
                self._outstanding[buffer] = len(chunks)
            if not chunks:
                self._free.put(buffer)
            for chunk in chunks:
                self._tasks.put((buffer, chunk))

    def _collect_loop(self) -> None:
        """Count what the writer processes report; notice a writer that died."""
        while True:
            try:
                message = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._processes if not p.is_alive()]
                if dead:
                    self._fail(f"writer process {dead[0].pid} died with exit code {dead[0].exitcode}")
                    return
                continue
            if message is None:
                return
            kind, buffer, what, payload = message  # what: the chunk's sample indices, or the failing one
            if kind == "error":
                self._fail(f"sample {self.samples[what].id!r}: {payload}")
                return
            self._samples_written(what, payload)
            self._release(buffer)

    # -- GPU side (calling thread) --
    def _acquire_buffer(self) -> int:
        started = time.perf_counter()
        while True:
            self._check()
            try:
                buffer = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        self._stats.forward_wait_s += time.perf_counter() - started
        return buffer

    def _copy_to_staging(self, buffer: int, packed: Sequence[torch.Tensor]) -> tuple[list, list]:
        """Start the copies of the gathered tensors into staging buffer `buffer`; returns (events, keep-alive)."""
        target = self.staging.tensors[buffer]
        events, keep_alive = [], []
        for k, tensor in enumerate(packed):
            destination = target[k, :tensor.shape[0]]
            if tensor.device.type != "cuda":
                destination.copy_(tensor)
                continue
            device = tensor.device
            stream = self._copy_streams.get(device)
            if stream is None:
                stream = self._copy_streams[device] = torch.cuda.Stream(device=device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                destination.copy_(tensor, non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning
                done.record(stream)
            tensor.record_stream(stream)  # the caching allocator must not reuse it before the copy ran
            events.append(done)
            keep_alive.append(tensor)
        return events, keep_alive

    def _write_inline(self, buffer: int, events: list, writes: list[tuple[int, int]]) -> None:
        for event in events:
            event.synchronize()
        target = self.staging.tensors[buffer]
        for index, offset in writes:
            sample = self.samples[index]
            rows = slice(offset, offset + sample.num_tokens)
            written = write_sample(self.output_dir, sample, [target[k, rows] for k in range(target.shape[0])])
            self._samples_written([index], written)
        self._free.put(buffer)

    def written(self) -> set[int]:
        """Indices of the samples this Extractor has written so far (complete on disk)."""
        with self._lock:
            return set(self._done)

    def run(self, text: TextModel, batches: Sequence[list[int]], complete: set[int] | None = None,
            progress=None, on_checkpoint=None, checkpoint_s: float = 60.0) -> ExtractionStats:
        """Forward every batch once and write its samples that are not in `complete` (indices into samples).

        A batch that holds some complete samples is still computed whole, so resumed files are bit-identical
        to those of an uninterrupted run with the same flags. `on_checkpoint(written)` is called at most every
        `checkpoint_s` seconds with the samples written so far (the stage refreshes index.jsonl with it).
        """
        complete = set(complete or ())
        self._stats = ExtractionStats()  # per call; the previous call has drained, so no writer still counts
        device = text.input_device
        on_gpu = device.type == "cuda"
        if on_gpu and not self._pinned:
            self._pinned = self.staging.pin()
        capture = LayerInputCapture(text.layers, self.aux_layers)
        started = last_checkpoint = time.perf_counter()
        try:
            for batch in batches:
                self._check()
                ids_cpu, flat_cpu = batch_inputs(self.samples, batch, pin=on_gpu)
                select = TokenSelector(flat_cpu, self.store_dtype)
                capture.arm(select)
                writes, offset = [], 0  # (sample index, first row in the staging buffer)
                for index in batch:
                    if index not in complete:
                        writes.append((index, offset))
                    offset += self.samples[index].num_tokens
                with torch.inference_mode(), inference_attention():
                    final = run_base(text, ids_cpu.to(device, non_blocking=True))
                    packed = capture.take() + [select(final)]
                    if writes:  # (a resumed batch whose samples are all on disk needs no copy)
                        buffer = self._acquire_buffer()
                        events, keep_alive = self._copy_to_staging(buffer, packed)
                del packed, final
                self._stats.batches += 1
                self._stats.tokens_forwarded += offset
                self._stats.padded_tokens += ids_cpu.numel()
                self._stats.tokens_written += sum(self.samples[i].num_tokens for i, _ in writes)
                if writes and self._processes:
                    self._jobs.put((buffer, events, keep_alive, writes))
                elif writes:
                    self._write_inline(buffer, events, writes)
                if progress is not None:
                    rate = self._stats.tokens_forwarded / (time.perf_counter() - started)
                    progress.update(len(writes), postfix=f"{rate:.0f} tok/s")
                if on_checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_s:
                    last_checkpoint = time.perf_counter()
                    on_checkpoint(self.written())
            drain_started = time.perf_counter()
            self._drain()
            self._stats.extra["drain_s"] = round(time.perf_counter() - drain_started, 3)
        except torch.cuda.OutOfMemoryError as err:
            raise RuntimeError(f"out of GPU memory on a batch of {len(batch)} sequences x {ids_cpu.shape[1]} tokens: "
                               f"lower --max-tokens-per-batch or --batch-size and rerun (finished samples are "
                               f"kept)") from err
        finally:
            capture.remove()
        self._stats.elapsed_s = time.perf_counter() - started
        return self._stats

    def _drain(self) -> None:
        """Wait until every buffer is back, i.e. every scheduled sample is on disk."""
        returned = []
        while len(returned) < len(self._outstanding):
            returned.append(self._acquire_buffer())
        for buffer in returned:
            self._free.put(buffer)
        self._check()


def forward_only(text: TextModel, samples: Sequence[Sample], batches: Sequence[list[int]]) -> float:
    """Seconds to run the same batches through the same base model with nothing captured or copied."""
    device = text.input_device
    on_gpu = device.type == "cuda"
    started = time.perf_counter()
    with torch.inference_mode(), inference_attention():
        for batch in batches:
            ids, _ = batch_inputs(samples, batch, pin=on_gpu)
            run_base(text, ids.to(device, non_blocking=True))
    synchronize_all()
    return time.perf_counter() - started


def synchronize_all() -> None:
    """Wait for every visible GPU (a sharded verifier ends its forward on the last one)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


# --- resume / reuse rules ---------------------------------------------------------------------------------

def resume_key(manifest: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for existing samples to be reused: everything that changes their content."""
    verifier = dict(manifest.get("verifier") or {})
    verifier.pop("path", None)
    return {
        "format_version": manifest.get("format_version"),
        "aux_layers": manifest.get("aux_layers"),
        "dtype": manifest.get("dtype"),
        "compute_dtype": manifest.get("compute_dtype"),
        "max_seq_len": (manifest.get("flags") or {}).get("max_seq_len"),
        "verifier": verifier,
        "verifier_path": manifest.get("verifier_resolved_path"),
        "prepared_data_sha256": ((manifest.get("inputs") or {}).get("prepared_data") or {}).get("sha256"),
    }


def resume_differences(existing: dict[str, Any], current: dict[str, Any]) -> list[str]:
    old, new = resume_key(existing), resume_key(current)
    differences = []
    for key in old:
        if isinstance(old[key], dict) and isinstance(new[key], dict):
            for sub in sorted(set(old[key]) | set(new[key])):
                if old[key].get(sub) != new[key].get(sub):
                    differences.append(f"{key}.{sub}: existing {old[key].get(sub)!r}, now {new[key].get(sub)!r}")
        elif old[key] != new[key]:
            differences.append(f"{key}: existing {old[key]!r}, now {new[key]!r}")
    return differences


# --- reading the output (stage 04) -----------------------------------------------------------------------

def open_hidden_states(data_dir: str | os.PathLike, require_complete: bool = True) -> tuple[dict, list[dict]]:
    """(manifest, index entries) of a stage-02 output; refuses an unfinished or foreign folder.

    Each entry is {"id", "path", "num_tokens", "loss_tokens"}; `path` is relative to data_dir.
    manifest["aux_layers"], ["hidden_size"], ["dtype"] and ["verifier"] describe the tensors.
    """
    manifest = load_manifest(data_dir, STAGE, "--data-dir", require_complete=require_complete)
    index = Path(data_dir) / manifest.get("index", INDEX_FILE)
    if not index.exists():
        raise UsageError(f"--data-dir {data_dir}: no {index.name}; rerun {STAGE}.py")
    with open(index) as handle:
        entries = [json.loads(line) for line in handle if line.strip()]
    return manifest, entries


def load_sample(data_dir: str | os.PathLike, entry: dict, mmap: bool = False) -> dict[str, torch.Tensor]:
    """One sample: aux [S, 3H] (aux_0 | aux_1 | aux_2 along the last dim), final [S, H], input_ids int64 [S],
    loss_mask uint8 [S]. Tensors keep the stored dtype (manifest["dtype"])."""
    folder = Path(data_dir) / entry["path"]

    def read(name: str):
        return torch.load(folder / name, map_location="cpu", weights_only=True, mmap=mmap)

    aux = torch.cat([read(name) for name in AUX_FILES], dim=-1)
    meta = read(META_FILE)
    return {"aux": aux, "final": read(FINAL_FILE), "input_ids": meta["input_ids"], "loss_mask": meta["loss_mask"]}
