"""Stage 02's writing side: durable, atomic sample folders, the shared staging buffers, and the writer processes."""
from __future__ import annotations

import logging
import mmap
import os
import shutil
import signal
import traceback
from pathlib import Path
from typing import Sequence

import torch

from eagle3_pipeline.formats.disk_full import DiskFull, disk_full, is_disk_full
from eagle3_pipeline.formats.hidden_states import (AUX_FILES, FINAL_FILE, META_BYTES_PER_TOKEN, META_FILE, RECORD_FILE,
    TMP_PREFIX, record_files)
from eagle3_pipeline.formats.prepared_data import Sample

STAGING_BUFFERS = 3  # one being filled by the GPU, up to two being written

# torch.save's per-record CRC32 runs at ~1.5 GB/s on one core and torch.load never checks it.
try:
    import torch.utils.serialization as _torch_serialization

    _SAVE_CONFIG = _torch_serialization.config.save
except (ImportError, AttributeError):  # older torch: keep its default
    _SAVE_CONFIG = None


def log() -> logging.Logger:
    return logging.getLogger("eagle3")


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


def stage_sample(output_dir: Path, sample: Sample, tensors: Sequence[torch.Tensor],
                 names: Sequence[str] = AUX_FILES + (FINAL_FILE,)) -> tuple[Path, list[Path], int]:
    """Write the per-token tensors (`names`: aux_0..2 and final, or those of another storage format), meta and
    the record of their sizes and checksums of one sample into its temporary folder: (folder, files, bytes)."""
    tmp_dir = staging_dir(output_dir, sample)
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    files, written = [], 0
    for name, tensor in zip(names, tensors, strict=True):
        torch.save(standalone(tensor), tmp_dir / name)
        files.append(tmp_dir / name)
        written += tensor.numel() * tensor.element_size()
    torch.save({"input_ids": sample.input_ids, "loss_mask": sample.loss_mask}, tmp_dir / META_FILE)
    files.append(tmp_dir / META_FILE)
    record_files(tmp_dir, [*names, META_FILE])  # sizes and CRC32s, read back from the page cache: what a later check compares with
    files.append(tmp_dir / RECORD_FILE)
    return tmp_dir, files, written + sample.num_tokens * META_BYTES_PER_TOKEN


def staging_dir(output_dir: Path, sample: Sample) -> Path:
    """Where this process writes a sample before the rename that publishes it."""
    final_dir = output_dir / sample.rel_path
    return final_dir.parent / f"{TMP_PREFIX}{final_dir.name}_{os.getpid()}"


def publish_sample(output_dir: Path, sample: Sample, tmp_dir: Path) -> None:
    """The rename that makes a sample count: before it, a crash leaves only a temporary folder."""
    os.replace(tmp_dir, output_dir / sample.rel_path)


DISK_FULL_FIX = ("The samples written before are whole and kept: free space (the disk estimate at the run's start says "
                 "how much the rest takes), then rerun the same command to resume.")


def write_samples(output_dir: Path, samples: Sequence[Sample], tensors: Sequence[Sequence[torch.Tensor]],
                  names: Sequence[str] = AUX_FILES + (FINAL_FILE,)) -> int:
    """Write several samples durably and atomically; returns the bytes written. A write that fails removes what it
    staged (the samples published before stay whole); a full disk is a DiskFull naming the bytes."""
    staged = []
    try:
        for sample, views in zip(samples, tensors):
            staged.append(stage_sample(output_dir, sample, views, names))
        flush_to_disk(output_dir, [path for _, files, _ in staged for path in files])
        for sample, (tmp_dir, _, _) in zip(samples, staged):
            publish_sample(output_dir, sample, tmp_dir)
    except Exception as err:
        needed = sum(t.numel() * t.element_size() for views in tensors for t in views) + \
            sum(sample.num_tokens * META_BYTES_PER_TOKEN for sample in samples)
        full = is_disk_full(err, output_dir, needed)
        for sample in samples:
            shutil.rmtree(staging_dir(output_dir, sample), ignore_errors=True)
        if full:
            failed = samples[min(len(staged), len(samples) - 1)]
            raise disk_full(output_dir / failed.rel_path, needed, f"the hidden states of {len(samples)} sample(s) "
                            f"(sample {failed.id!r} among them)", DISK_FULL_FIX) from None
        raise
    return sum(written for _, _, written in staged)


def write_sample(output_dir: Path, sample: Sample, tensors: Sequence[torch.Tensor],
                 names: Sequence[str] = AUX_FILES + (FINAL_FILE,)) -> int:
    """Write one sample durably into a temp folder, then rename it into place."""
    return write_samples(output_dir, [sample], [tensors], names)


class StagingBuffers:
    """Host buffers that batches are copied into and written from: per buffer one tensor [capacity, *row] per
    field (file) of the storage format, e.g. 4 x [capacity, H] for bf16 aux + final.

    They live in an anonymous shared mapping (inherited by the forked writer processes, no /dev/shm needed)
    and, on a GPU run, are page-locked with cudaHostRegister so device-to-host copies run asynchronously.
    """

    def __init__(self, count: int, capacity_tokens: int, fields: Sequence[tuple[str, tuple[int, ...], torch.dtype]]):
        self.capacity = max(1, capacity_tokens)
        self.fields = [(name, tuple(row), dtype) for name, row, dtype in fields]
        self.names = tuple(name for name, _, _ in self.fields)
        self.sizes = [self.capacity * int(torch.Size(row).numel()) * torch.empty(0, dtype=dtype).element_size()
                      for _, row, dtype in self.fields]
        self.offsets, end = [], 0
        for size in self.sizes:  # each field starts 64-byte aligned
            self.offsets.append((end + 63) // 64 * 64)
            end = self.offsets[-1] + size
        nbytes = self.offsets[-1] + self.sizes[-1]
        self.maps = [mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED) for _ in range(count)]
        self.nbytes = nbytes
        self.tensors = [self.view(m) for m in self.maps]
        self.registered: list[int] = []

    def view(self, mapping: mmap.mmap) -> list[torch.Tensor]:
        raw = torch.frombuffer(mapping, dtype=torch.uint8)
        return [raw[start:start + size].view(dtype).view(self.capacity, *row)
                for start, size, (_, row, dtype) in zip(self.offsets, self.sizes, self.fields)]

    def pin(self) -> bool:
        """Page-lock the buffers for asynchronous GPU copies; False (and a warning) when the driver refuses."""
        cudart = torch.cuda.cudart()
        for tensor in self.tensors:
            # Portable: page-locked for every GPU's context, as a sharded verifier copies from several.
            code = int(cudart.cudaHostRegister(tensor[0].data_ptr(), self.nbytes, 1))
            if code != 0:
                log().warning("could not page-lock the staging buffers (cudaHostRegister error %d): device-to-host "
                              "copies will be synchronous and slower", code)
                return False
            self.registered.append(tensor[0].data_ptr())
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
            views = [[field[offset:offset + samples[i].num_tokens] for field in staging_rows] for i, offset in chunk]
            written = write_samples(folder, [samples[i] for i, _ in chunk], views, staging.names)
            results.put(("done", buffer, [index for index, _ in chunk], written))
        except DiskFull as err:  # the message is all the parent needs
            results.put(("disk_full", buffer, index, str(err)))
            return
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops the stage
            results.put(("error", buffer, index, traceback.format_exc()))
            return
