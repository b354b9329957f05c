"""The sink of stage 02's SGLang capture: captured batches written as sample folders, off the forward, with the disk
as the only limit (docs/extraction.md)."""
from __future__ import annotations

import os
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from patches.sglang_capture import CaptureError, CapturedBatch, RequestRows, sample_rid

PENDING_BATCHES = 3  # captured batches held in host memory while writers save them; more blocks the forward


def _disable_save_crc() -> None:
    """torch.save's per-record CRC32 costs ~1.5 GB/s of one core and torch.load never checks it."""
    try:
        import torch.utils.serialization as serialization

        serialization.config.save.compute_crc32 = False
    except (ImportError, AttributeError):
        pass


class SampleFileWriter:
    """Writes captured requests as stage-02 sample folders (eagle3_pipeline.extract.writer.write_samples), off the
    forward.

    Each batch is gathered on the device (the requests' rows, in the stored dtype) and copied to the host once,
    into one of PENDING_BATCHES reusable buffers (page-locked on a GPU); writer threads save the samples from
    there while the engine computes the next batch. When every buffer is still being written, the forward waits:
    the disk is then the limit. `journal(position)` is called once a sample folder is complete on disk.
    """

    def __init__(self, output_dir: str | os.PathLike, samples: Sequence[Any], store_dtype: torch.dtype,
                 num_workers: int, journal: Callable[[int], None] | None = None,
                 on_error: Callable[[str], None] | None = None, pending_batches: int = PENDING_BATCHES,
                 aux_layers: Sequence[int] = ()):
        from eagle3_pipeline.extract.writer import write_samples

        self._write_samples = write_samples
        self.num_workers = max(1, num_workers)
        self.output_dir = Path(output_dir)
        self.samples = samples
        self.store_dtype = store_dtype
        self.aux_layers = list(aux_layers)
        self.journal = journal
        self.on_error = on_error
        self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="eagle3-writer")
        self._free: list[torch.Tensor] = []
        self._slots = threading.Semaphore(pending_batches)
        self._lock = threading.Lock()
        self._taken: set[int] = set()  # samples accepted (a re-run prefill of the same request is written once)
        self._error: str | None = None
        self.samples_written = 0
        self.bytes_written = 0
        _disable_save_crc()

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing a sample failed:\n{self._error}")

    def _checked(self, batch: CapturedBatch) -> list[RequestRows]:
        """The batch's requests still to write, after checking each is the sample its id names."""
        todo = []
        input_ids = batch.input_ids.to("cpu", torch.int64)  # one small copy for all the requests
        for request in batch.requests:
            if request.position in self._taken:
                continue
            if not 0 <= request.position < len(self.samples):
                raise CaptureError(f"request {sample_rid(request.position)} names no sample of the prepared data")
            sample = self.samples[request.position]
            if request.length != sample.num_tokens:
                raise CaptureError(f"sample {sample.id!r}: {request.length} tokens in the forward, {sample.num_tokens} "
                                   f"in the prepared data")
            if not torch.equal(input_ids[request.start:request.start + request.length], sample.input_ids):
                raise CaptureError(f"sample {sample.id!r}: the forward's token ids differ from the prepared data's")
            todo.append(request)
        return todo

    def _buffer(self, count: int, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """A host buffer of at least [count, rows, width] (reused; page-locked when the tensors are on a GPU)."""
        with self._lock:
            for index, buffer in enumerate(self._free):
                if buffer.shape[0] == count and buffer.shape[1] >= rows and buffer.shape[2] == width:
                    return self._free.pop(index)
            if self._free:
                self._free.pop(0)  # too small: replaced by a larger one
        return torch.empty((count, max(rows, 1), width), dtype=self.store_dtype, pin_memory=device.type == "cuda")

    def write_batch(self, batch: CapturedBatch) -> None:
        self.check()
        todo = self._checked(batch)
        if not todo:
            return
        device = batch.tensors[0].device
        index = torch.cat([torch.arange(r.start, r.start + r.length) for r in todo]).to(device)
        gathered = [tensor.index_select(0, index).to(self.store_dtype) for tensor in batch.tensors]
        self._refuse_nonfinite(todo, gathered)
        self._slots.acquire()  # back-pressure: wait for a buffer the writers have finished with
        try:
            buffer = self._buffer(len(gathered), index.numel(), gathered[0].shape[-1], device)
            for k, tensor in enumerate(gathered):
                buffer[k, :tensor.shape[0]].copy_(tensor)  # device-to-host; waits for the forward's kernels
        except BaseException:
            self._slots.release()
            raise
        del gathered
        rows, offset = [], 0  # each request's first row in the buffer
        for request in todo:
            rows.append(offset)
            offset += request.length
        with self._lock:
            self._taken.update(r.position for r in todo)
        # One chunk per writer: write_samples makes a chunk durable with one file-system sync, then renames its
        # samples into place.
        work = list(zip(todo, rows))
        chunks = [work[i::self.num_workers] for i in range(self.num_workers) if work[i::self.num_workers]]
        remaining = [len(chunks)]
        for chunk in chunks:
            self._pool.submit(self._write_chunk, chunk, buffer, remaining)

    def _refuse_nonfinite(self, todo: list[RequestRows], gathered: list[torch.Tensor]) -> None:
        """NaN/inf never reach the disk: one reduction for the batch, then (only when found) the samples and the
        layer where they first appear, as the hf backend reports them (eagle3_pipeline.extract.finite)."""
        from eagle3_pipeline.extract.finite import all_finite, first_nonfinite, layer_names, nonfinite_failure

        if bool(all_finite(gathered)):
            return
        names, found, offset = layer_names(self.aux_layers), {}, 0
        for request in todo:
            where = first_nonfinite([t[offset:offset + request.length] for t in gathered], names)
            if where is not None:
                found[self.samples[request.position].id] = where
            offset += request.length
        raise CaptureError(str(nonfinite_failure(found)))

    def _write_chunk(self, chunk: list[tuple[RequestRows, int]], buffer: torch.Tensor, remaining: list[int]) -> None:
        try:
            if self._error is None:
                samples = [self.samples[request.position] for request, _ in chunk]
                views = [[buffer[k, row:row + request.length] for k in range(buffer.shape[0])]
                         for request, row in chunk]
                written = self._write_samples(self.output_dir, samples, views)
                with self._lock:
                    self.samples_written += len(chunk)
                    self.bytes_written += written
                if self.journal is not None:
                    for request, _ in chunk:
                        self.journal(request.position)
        except BaseException:  # noqa: BLE001 - recorded; the next batch raises it in the engine
            ids = ", ".join(repr(self.samples[request.position].id) for request, _ in chunk[:5])
            message = f"samples {ids}:\n{traceback.format_exc()}"
            with self._lock:
                self._error = self._error or message
            if self.on_error is not None:
                self.on_error(message)
        finally:
            with self._lock:
                remaining[0] -= 1
                done = remaining[0] == 0
                if done:
                    self._free.append(buffer)
            if done:
                self._slots.release()

    def close(self) -> None:
        """Wait until every accepted sample is on disk (or failed), then stop the writers."""
        self._pool.shutdown(wait=True)
        self.check()
