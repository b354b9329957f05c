"""Capture hooks for stage 02's SGLang backend: the aux residual streams and the final hidden state of every
prompt token, written as the same sample folders as the hf backend. What is hooked and why: docs/extraction.md."""
from __future__ import annotations

import functools
import importlib
import json
import os
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from eagle3_pipeline.verifier.capture import capture_layer_ids

PLAN_ENV = "EAGLE3_SGLANG_CAPTURE_PLAN"  # path of the capture plan; set by stage 02 for SGLang's processes
RID_PREFIX = "eagle3-"
PLAN_FILE = ".sglang_capture_plan.json"
JOURNAL_FILE = ".sglang_written.txt"  # one sample position per line, appended once the sample folder is in place
ERROR_FILE = ".sglang_capture_error.txt"
ACTIVE_FILE = ".sglang_hooks_active.json"

# The classes hooked are each release's text_models (patches/sglang_releases.py). What the capture relies on in them
# and the ForwardBatch fields it reads, alike in every checked release (tests/test_sglang.py checks each release):
TEXT_MODEL_ATTRIBUTES = ("layers", "norm", "layers_to_capture")
FORWARD_BATCH_FIELDS = ("forward_mode", "rids", "input_ids", "extend_seq_lens_cpu", "extend_prefix_lens_cpu")
CAPTURE_MODE = "EXTEND"  # ForwardMode member of a plain prefill forward


class CaptureError(RuntimeError):
    """The engine runs in a way that cannot give one exact row per prompt token; says which setting to change."""


def sample_rid(position: int) -> str:
    return f"{RID_PREFIX}{position}"


def rid_position(rid: Any) -> int | None:
    """The sample position of a stage-02 request id, None for any other request (warm-up, health checks)."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
        return None
    tail = rid[len(RID_PREFIX):]
    return int(tail) if tail.isdigit() else None


# --- which rows of a forward belong to which sample ---------------------------------------------------------

@dataclass(frozen=True)
class RequestRows:
    position: int  # the sample's line position in the prepared data
    start: int  # its first row in the forward's [T, H] tensors
    length: int


def requests_of(forward_batch: Any) -> tuple[list[RequestRows], int] | None:
    """(stage-02 requests of this forward with their rows, rows in the forward), or None when it holds none.

    A prefill forward lays its requests' new tokens one after another, in request order; with the prefix
    cache and chunked prefill off each request's new tokens are the whole prompt.
    """
    rids = list(getattr(forward_batch, "rids", None) or [])
    positions = [rid_position(rid) for rid in rids]
    if all(position is None for position in positions):
        return None
    # A mixed batch reaches the model as MIXED (0.5.17), refused here, or as EXTEND (0.5.23: a decode tail is then a
    # one-token extend whose prefix is cached), refused by the prefix check below.
    mode = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
    if mode != CAPTURE_MODE:
        raise CaptureError(f"a {mode} forward holds stage-02 requests: they are prefill-only (max_new_tokens=0), so "
                           f"only {CAPTURE_MODE} forwards should; no speculative decoding or mixed chunks "
                           f"(enable_mixed_chunk=False) in stage 02's engine")
    lengths = forward_batch.extend_seq_lens_cpu
    prefixes = forward_batch.extend_prefix_lens_cpu
    if lengths is None or len(lengths) != len(rids):
        raise CaptureError(f"the prefill forward has {len(rids)} requests but extend_seq_lens_cpu={lengths!r}")
    found, start = [], 0
    for rid, position, length, prefix in zip(rids, positions, lengths, prefixes or [0] * len(rids)):
        if position is not None:
            if prefix:
                raise CaptureError(f"request {rid}: {prefix} of its tokens were not recomputed (prefix cache or "
                                   f"chunked prefill); run with disable_radix_cache=True and chunked_prefill_size=-1")
            found.append(RequestRows(position, start, int(length)))
        start += int(length)
    return found, start


def split_aux(aux: Any, count: int, hidden_size: int) -> list[torch.Tensor]:
    """The captured layers as [T, H] tensors, from a list (Llama) or one packed [T, count*H] tensor (DeepSeek)."""
    if torch.is_tensor(aux):
        if aux.shape[-1] != count * hidden_size:
            raise CaptureError(f"packed aux hidden states of width {aux.shape[-1]}, expected {count} x {hidden_size}")
        return list(aux.split(hidden_size, dim=-1))
    parts = list(aux)
    if len(parts) != count:
        raise CaptureError(f"{len(parts)} aux hidden states captured, expected {count}")
    return parts


@dataclass
class CapturedBatch:
    requests: list[RequestRows]
    input_ids: torch.Tensor  # [T] every token id of the forward
    tensors: list[torch.Tensor]  # aux_0, aux_1, aux_2 then final: [T, H] each, on the model's device


# --- the hooks ----------------------------------------------------------------------------------------------

def _forward_batch_of(args: tuple, kwargs: dict) -> Any:
    return kwargs["forward_batch"] if "forward_batch" in kwargs else (args[2] if len(args) > 2 else None)


class CaptureHooks:
    """Wraps `forward` of text-model classes with SGLang's contract (see the module docstring).

    `sink()` returns the object that receives each CapturedBatch; only the writing rank makes one, in a thread
    started as soon as a hooked text model is built (torch.distributed is up by then, so the rank is known), so
    reading the prepared data overlaps the weight loading instead of holding the first forward while the other
    ranks wait in NCCL. `is_writer()` says whether this process writes; `on_error(message)` records a failure
    before it propagates (the engine then stops); `on_first_batch(module)` runs once per process.
    """

    def __init__(self, layer_ids: Sequence[int], sink: Callable[[], Any], is_writer: Callable[[], bool] = lambda: True,
                 on_error: Callable[[str], None] | None = None, on_first_batch: Callable[[Any], None] | None = None):
        self.layer_ids = capture_layer_ids(layer_ids)  # the hf backend's rule: SGLang's layers_to_capture = [l]
        self._sink_factory, self._sink = sink, None
        self._reader: threading.Thread | None = None
        self._reader_error: BaseException | None = None
        self.is_writer = is_writer
        self.on_error = on_error
        self.on_first_batch = on_first_batch
        self._patched: list[tuple[type, Callable]] = []
        self.batches = 0

    def install(self, *classes: type) -> "CaptureHooks":
        for cls in classes:
            originals = {name: cls.__dict__.get(name) for name in ("forward", "__init__")}
            for name, original in originals.items():
                if original is None:
                    raise TypeError(f"{cls.__name__} defines no {name} of its own to wrap")
                if getattr(original, "__eagle3_capture__", False):
                    raise RuntimeError(f"{cls.__name__}.{name} already carries stage-02 capture hooks")
            cls.forward = self._wrap(originals["forward"])
            cls.__init__ = self._wrap_init(originals["__init__"])
            self._patched.append((cls, originals))
        return self

    def remove(self) -> None:
        for cls, originals in reversed(self._patched):
            for name, original in originals.items():
                setattr(cls, name, original)
        self._patched = []

    def _wrap_init(self, original: Callable) -> Callable:
        hooks = self

        @functools.wraps(original)
        def __init__(module, *args, **kwargs):
            original(module, *args, **kwargs)
            hooks.start_reader()

        __init__.__eagle3_capture__ = True
        return __init__

    def start_reader(self) -> None:
        """On the writing rank, make the sink (it reads the prepared data) in a thread; once per process."""
        if self._reader is not None or self._sink is not None or not self.is_writer():
            return

        def read() -> None:
            try:
                with torch.device("cpu"):  # whatever default device the model's construction set
                    self._sink = self._sink_factory()
            except BaseException as err:  # noqa: BLE001 - kept for the first forward, and recorded now
                self._reader_error = err
                self._report(err)

        self._reader = threading.Thread(target=read, name="eagle3-read-prepared-data", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether the sink is made (waiting up to `timeout` s for the reader); re-raises the reader's error."""
        if self._reader is not None:
            self._reader.join(timeout)
        if self._reader_error is not None:
            raise RuntimeError("reading the prepared data failed") from self._reader_error
        return self._sink is not None

    def _sink_for_batch(self) -> Any:
        if self._reader is None and self._sink is None:
            self.start_reader()  # a model built before the hooks were installed
        self.wait_ready()
        return self._sink

    def _wrap(self, original: Callable) -> Callable:
        hooks = self

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            forward_batch = _forward_batch_of(args, kwargs)
            try:
                found = requests_of(forward_batch) if forward_batch is not None else None
            except CaptureError as err:
                hooks._fail(err)
                raise
            if not found:
                return original(module, *args, **kwargs)
            return hooks._capture(original, module, args, kwargs, forward_batch, *found)

        forward.__eagle3_capture__ = True
        return forward

    def _capture(self, original, module, args, kwargs, forward_batch, requests: list[RequestRows], rows: int):
        previous = module.layers_to_capture
        if previous and list(previous) != self.layer_ids:
            error = CaptureError(f"{type(module).__name__}.layers_to_capture is already {list(previous)} (speculative "
                                 f"decoding?); stage 02 runs the engine without a drafter")
            self._fail(error)
            raise error
        module.layers_to_capture = list(self.layer_ids)
        try:
            out = original(module, *args, **kwargs)
        finally:
            module.layers_to_capture = previous
        try:
            if not (isinstance(out, tuple) and len(out) == 2 and torch.is_tensor(out[0])):
                raise CaptureError(f"{type(module).__name__}.forward returned {type(out).__name__}, not (hidden states, "
                                   f"aux); pipeline parallelism (pp_size > 1) is not supported")
            hidden, aux = out
            if self.is_writer():
                tensors = split_aux(aux, len(self.layer_ids), hidden.shape[-1]) + [hidden]
                for tensor in tensors:
                    if tensor.shape[0] != rows:
                        raise CaptureError(f"the forward has {tensor.shape[0]} rows for {rows} prompt tokens: rows are "
                                           f"split or padded across ranks (data-parallel attention, scattered "
                                           f"attention input); run with attn_dp_size=1 and "
                                           f"enable_attn_tp_input_scattered=False")
                if self.batches == 0 and self.on_first_batch is not None:
                    self.on_first_batch(module)
                self._sink_for_batch().write_batch(CapturedBatch(requests, forward_batch.input_ids, tensors))
                self.batches += 1
        except Exception as err:
            self._fail(err)
            raise
        return hidden

    def _report(self, err: BaseException) -> None:
        if self.on_error is not None:
            self.on_error("".join(traceback.format_exception(err)))

    def _fail(self, err: BaseException) -> None:
        """Record a failure in a forward and let the writers finish the samples already accepted: SGLang answers
        the exception by killing the engine's process tree, and what is on disk by then is kept for the resume.
        The writers finish first: stage 02 stops the engine as soon as it sees the error file."""
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:  # noqa: BLE001 - a writer's failure is in the error file already
                pass
        self._report(err)


# --- the plan stage 02 hands to SGLang's processes ----------------------------------------------------------

@dataclass
class CapturePlan:
    """What the hooks in SGLang's processes need: written by stage 02 as OUTPUT_DIR/.sglang_capture_plan.json."""
    output_dir: str
    prepared_data: str
    vocab_size: int
    max_seq_len: int
    aux_layers: list[int]
    dtype: str
    num_workers: int
    sglang_version: str  # the installed SGLang stage 02 checked
    sglang_release: str  # whose entry in patches/sglang_releases.py applies (an untested version: the newest's)

    @property
    def folder(self) -> Path:
        return Path(self.output_dir)

    @property
    def path(self) -> Path:
        return self.folder / PLAN_FILE

    def write(self) -> Path:
        from eagle3_pipeline.formats.files import write_text_atomic

        write_text_atomic(self.path, json.dumps(asdict(self), indent=2) + "\n")
        return self.path

    @classmethod
    def read(cls, path: str | os.PathLike) -> "CapturePlan":
        return cls(**json.loads(Path(path).read_text()))

    def clear_reports(self) -> None:
        for name in (JOURNAL_FILE, ERROR_FILE, ACTIVE_FILE):
            (self.folder / name).unlink(missing_ok=True)

    def record_error(self, message: str) -> None:
        """Keep the first failure where stage 02 (and the user) will find it: the engine dies right after."""
        path = self.folder / ERROR_FILE
        if not path.exists():
            path.write_text(message)

    def mark_active(self, module: Any) -> None:
        from patches import installed_sglang_version

        record = {"pid": os.getpid(), "text_model": type(module).__name__, "layers": self.aux_layers,
                  "sglang_version": installed_sglang_version(), "sglang_release": self.sglang_release}
        (self.folder / ACTIVE_FILE).write_text(json.dumps(record) + "\n")

    def open_writer(self) -> "SampleFileWriter":
        """The sink in the writing SGLang process: the prepared data read the same way stage 02 read it."""
        from eagle3_pipeline.formats.prepared_data import read_prepared_data
        from patches.sample_writer import SampleFileWriter

        samples, _ = read_prepared_data(self.prepared_data, self.vocab_size, self.max_seq_len)
        journal_path = self.folder / JOURNAL_FILE
        handle = open(journal_path, "a", buffering=1)  # line-buffered: stage 02 follows it for progress
        lock = threading.Lock()

        def journal(position: int) -> None:
            with lock:
                handle.write(f"{position}\n")

        return SampleFileWriter(self.folder, samples, getattr(torch, self.dtype), self.num_workers, journal,
                                on_error=self.record_error, aux_layers=self.aux_layers)


def is_first_rank() -> bool:
    """True in TP rank 0's process (the global rank 0 with pipeline and data parallelism off), or alone."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def install_from_environment() -> CaptureHooks | None:
    """In SGLang's processes: wrap the text models when stage 02 left a capture plan in the environment."""
    plan_path = os.environ.get(PLAN_ENV)
    if not plan_path:
        return None
    from patches import installed_sglang_version
    from patches.sglang_releases import RELEASES

    plan = CapturePlan.read(plan_path)
    installed = installed_sglang_version()
    if installed != plan.sglang_version:  # stage 02's preflight checked another Python environment's SGLang
        problem = f"SGLang's processes run SGLang {installed}, but stage 02 checked {plan.sglang_version}"
        plan.record_error(problem)
        raise ImportError(problem)
    classes = [getattr(importlib.import_module(model.module), model.name)
               for model in RELEASES[plan.sglang_release].text_models]
    return install_plan_hooks(plan, classes)


def install_plan_hooks(plan: CapturePlan, classes: Sequence[type]) -> CaptureHooks:
    """The capture hooks of a plan, installed on `classes` (SGLang's text models; a stand-in's in the tests)."""
    return CaptureHooks(plan.aux_layers, plan.open_writer, is_first_rank, plan.record_error,
                        plan.mark_active).install(*classes)


# SGLang imports this module in each of its processes (patches/__init__.py says how); outside a stage-02 run
# (no plan in the environment) importing it changes nothing.
INSTALLED_HOOKS = install_from_environment()
