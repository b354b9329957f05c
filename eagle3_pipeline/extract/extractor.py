"""Stage 02's engine: Extractor runs planned batches through the verifier's text model and hands every sample to
the writers, overlapping the GPU with the disk (why it is built this way: docs/extraction.md)."""
from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from eagle3_pipeline.extract.finite import all_finite, first_nonfinite, layer_names, nonfinite_failure
from eagle3_pipeline.extract.plan import batch_inputs
from eagle3_pipeline.extract.writer import _SAVE_CONFIG, STAGING_BUFFERS, StagingBuffers, _writer_process, write_sample
from eagle3_pipeline.formats.disk_full import DiskFull
from eagle3_pipeline.formats.storage import StorageFormat, encode
from eagle3_pipeline.formats.prepared_data import Sample
from eagle3_pipeline.verifier.capture import LayerInputCapture, TextModel, TokenSelector, capture_batch, run_base
from eagle3_pipeline.model.kernels import sdpa_without_cudnn


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
        "skipped_nonfinite": {k: v for s in summaries for k, v in (s.get("skipped_nonfinite") or {}).items()},
        "world_size": len(summaries),
        "ranks": list(summaries),
    })
    return merged


class Extractor:
    """Runs planned batches through a verifier's text model and writes every sample not yet complete.

    Create it BEFORE loading the model: it forks the writer processes, which should not inherit a CUDA
    context or a model. `num_workers` = 0 writes in the calling thread (no overlap; simplest to debug).
    The stage and scripts/lab/bench_extraction.py both call `run`, so the benchmark measures this code.
    """

    def __init__(self, output_dir: str | os.PathLike, samples: Sequence[Sample], batches: Sequence[list[int]],
                 aux_layers: Sequence[int], hidden_size: int, store_dtype: torch.dtype, num_workers: int,
                 staging_buffers: int = STAGING_BUFFERS, skip_nonfinite: bool = False,
                 storage: StorageFormat | None = None):
        self.output_dir = Path(output_dir)
        self.skip_nonfinite = skip_nonfinite
        self._nonfinite: dict[str, str] = {}  # sample id -> where its values first stop being finite
        self.samples = samples
        self.aux_layers = list(aux_layers)
        self.hidden_size = hidden_size
        self.store_dtype = store_dtype
        dtype_name = str(store_dtype).split(".")[-1]
        self.storage = storage or StorageFormat(dtype_name, "final", dtype=dtype_name)
        capacity = max((sum(samples[i].num_tokens for i in batch) for batch in batches), default=1)
        self.staging = StagingBuffers(staging_buffers, capacity, self.storage.fields(hidden_size))
        self.num_workers = num_workers
        self._saved_crc = _SAVE_CONFIG.compute_crc32 if _SAVE_CONFIG is not None else None
        if _SAVE_CONFIG is not None:
            _SAVE_CONFIG.compute_crc32 = False
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(staging_buffers):
            self._free.put(index)
        self._lock = threading.Lock()
        self._outstanding = [0] * staging_buffers
        self._error: str | None = None
        self._disk_full: str | None = None  # a writer's message for a full disk (DiskFull)
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
        if self._nonfinite and not self.skip_nonfinite:
            raise nonfinite_failure(self._nonfinite)
        if self._disk_full is not None:
            raise DiskFull(self._disk_full)
        if self._error is not None:
            raise RuntimeError(f"writing hidden states failed:\n{self._error}")

    def _samples_written(self, indices: list[int], written_bytes: int) -> None:
        with self._lock:
            self._stats.samples_written += len(indices)
            self._stats.files_written += len(indices) * len(self.storage.files())
            self._stats.bytes_written += written_bytes
            self._done.update(indices)

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
            buffer, events, keep_alive, writes, finite = job
            try:
                for event in events:
                    event.synchronize()
                writes = self._finite_writes(buffer, writes, finite)
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
            if kind == "disk_full":
                with self._lock:
                    self._disk_full = payload
                return
            if kind == "error":
                self._fail(f"sample {self.samples[what].id!r}: {payload}")
                return
            self._samples_written(what, payload)
            self._release(buffer)

    @staticmethod
    def _finite_flag(packed: Sequence[torch.Tensor]) -> torch.Tensor:
        """all_finite on the device, copied to the host behind the batch's own copies: whoever waits for those
        reads it without a device sync (which would wait for the batches queued after this one too)."""
        finite = all_finite(packed)
        if finite.device.type != "cuda":
            return finite
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(finite, non_blocking=True)
        return host

    def _finite_writes(self, buffer: int, writes: list[tuple[int, int]], finite: torch.Tensor) -> list:
        """The writes of a batch whose states are all finite; the others are recorded (and with --skip-nonfinite
        left out, else the stage stops). The flag was computed on the device; the search runs only when it fails."""
        if bool(finite):
            return writes
        target = self.staging.tensors[buffer]
        names = layer_names(self.aux_layers)[:3] + list(self.staging.names[3:])
        kept, found = [], {}
        for index, offset in writes:
            rows = slice(offset, offset + self.samples[index].num_tokens)
            where = first_nonfinite([field[rows].float() for field in target], names)
            if where is None:
                kept.append((index, offset))
            else:
                found[self.samples[index].id] = where
        with self._lock:
            self._nonfinite.update(found)
        if not self.skip_nonfinite:
            return []
        return kept

    def skipped_nonfinite(self) -> dict[str, str]:
        with self._lock:
            return dict(self._nonfinite)

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
            destination = target[k][:tensor.shape[0]]
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

    def _write_inline(self, buffer: int, events: list, writes: list[tuple[int, int]], finite) -> None:
        for event in events:
            event.synchronize()
        writes = self._finite_writes(buffer, writes, finite)
        target = self.staging.tensors[buffer]
        for index, offset in writes:
            sample = self.samples[index]
            rows = slice(offset, offset + sample.num_tokens)
            written = write_sample(self.output_dir, sample, [field[rows] for field in target], self.staging.names)
            self._samples_written([index], written)
        self._free.put(buffer)

    @staticmethod
    def _lm_head(text: TextModel) -> torch.Tensor | None:
        return getattr(text.lm_head, "weight", None)

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
                # the stored dtype, or as computed when the format encodes them (FP8, top-k) on the device
                select = TokenSelector(flat_cpu, self.store_dtype if self.storage.as_computed else None)
                writes, offset = [], 0  # (sample index, first row in the staging buffer)
                for index in batch:
                    if index not in complete:
                        writes.append((index, offset))
                    offset += self.samples[index].num_tokens
                with torch.inference_mode(), sdpa_without_cudnn():
                    packed = capture_batch(text, capture, ids_cpu.to(device, non_blocking=True), select)
                    finite = self._finite_flag(packed) if writes else None  # NaN/inf: checked before writing
                    if writes and not self.storage.as_computed:
                        packed = encode(self.storage, packed[:-1], packed[-1], self._lm_head(text))
                    if writes:  # (a resumed batch whose samples are all on disk needs no copy)
                        buffer = self._acquire_buffer()
                        events, keep_alive = self._copy_to_staging(buffer, packed)
                del packed
                self._stats.batches += 1
                self._stats.tokens_forwarded += offset
                self._stats.padded_tokens += ids_cpu.numel()
                self._stats.tokens_written += sum(self.samples[i].num_tokens for i, _ in writes)
                if writes and self._processes:
                    self._jobs.put((buffer, events, keep_alive, writes, finite))
                elif writes:
                    self._write_inline(buffer, events, writes, finite)
                if progress is not None:
                    rate = self._stats.tokens_forwarded / (time.perf_counter() - started)
                    progress.update(len(writes), postfix=f"{rate:.0f} tok/s")
                if on_checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_s:
                    last_checkpoint = time.perf_counter()
                    on_checkpoint(self.written())
            drain_started = time.perf_counter()
            self._drain()
            self._stats.extra["drain_s"] = round(time.perf_counter() - drain_started, 3)
            self._stats.extra["skipped_nonfinite"] = self.skipped_nonfinite()
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
    with torch.inference_mode(), sdpa_without_cudnn():
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
