"""Stage 04's data: the validation split, the seeded batch plan of each epoch, its share per rank and step,
and the dataset and loader that feed train_step."""
from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from eagle3_pipeline.batching import pack_by_length
from eagle3_pipeline.errors import StageFailure
from eagle3_pipeline.model.kernels import FP8_ALIGN

VAL_SPLIT_FILE = "val_split.json"
# Samples sorted by length together: large enough for little padding, small enough that the batches
# change from epoch to epoch.
BUCKET_WINDOW = 1024


def split_train_val(ids: Sequence[str], val_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    """Positions of training and validation samples: a seeded shuffle of the ids, decided per sample.

    The order of the index file does not matter (ids are sorted first), so re-running stage 02 in another
    order gives the same split.
    """
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    rng = np.random.default_rng([seed, 0x5A17])
    shuffled = [order[i] for i in rng.permutation(len(order))]
    n_val = int(round(val_ratio * len(ids)))
    if val_ratio > 0 and n_val == 0 and len(ids) > 1:
        n_val = 1
    n_val = min(n_val, max(len(ids) - 1, 0))
    return sorted(shuffled[n_val:]), sorted(shuffled[:n_val])


def round_up(length, multiple: int):
    """`length` (an int or an array of them) rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def plan_batches(lengths: Sequence[int], max_tokens: int, max_sequences: int, seed: int, epoch: int,
                 shuffle: bool = True, pad_to: int = 1) -> list[list[int]]:
    """The batches of one epoch as lists of positions into `lengths`, deterministic from (seed, epoch).

    Samples are shuffled, sorted by length inside windows of BUCKET_WINDOW (similar lengths share a batch,
    so little padding), packed to at most `max_tokens` padded tokens and `max_sequences` sequences, and
    the batches shuffled. Without `shuffle` (validation) the whole set is sorted once. Packing counts each
    length rounded up to `pad_to`, as collate pads it, so the bound holds for the padded batch.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = round_up(lengths, pad_to)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    window = BUCKET_WINDOW if shuffle else max(len(lengths), 1)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        batches.extend(pack_by_length(chunk.tolist(), padded, max_tokens, max_sequences))
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def steps_in_epoch(num_batches: int, grad_accum: int) -> int:
    return math.ceil(num_batches / grad_accum)


def step_shares(num_batches: int, start: int, micro_per_step: int, world_size: int = 1,
                rank: int = 0) -> list[tuple[int, list[tuple[int, float]]]]:
    """One rank's part of each optimizer step of an epoch plan, from plan position `start` on.

    A step takes the plan's next `micro_per_step` micro-batches (grad-accum x ranks; fewer at the epoch's
    end), whatever the number of ranks, so 2 ranks with --grad-accum 1 train on exactly the batches of one
    process with --grad-accum 2. Rank r takes every world_size-th of them from the r-th, each weighted by
    its share 1/n of the step's mean loss; a rank left without one (a short last step) gets a stand-in, a
    batch of that step with weight 0, so that it still takes part in the gradient reduction.
    Returns [(plan position after the step, [(plan position, weight), ...]), ...].
    """
    steps = []
    for begin in range(start, num_batches, micro_per_step):
        end = min(begin + micro_per_step, num_batches)
        share = [(index, 1.0 / (end - begin)) for index in range(begin + rank, end, world_size)]
        steps.append((end, share or [(end - 1, 0.0)]))
    return steps


class HiddenStateDataset(Dataset):
    """One stage-02 sample per item, read through eagle3_pipeline.formats.hidden_states and cut to max_seq_len.

    The first time a run reads a sample, its files are checked against the sizes and CRC32s stage 02 recorded
    (check_sample_files): damage found then stops the run naming the sample, where reading on would feed the
    drafter wrong values (docs/training.md, what it costs)."""

    def __init__(self, data_dir: str | Path, entries: Sequence[dict], max_seq_len: int):
        self.data_dir = str(data_dir)
        self.entries = list(entries)
        self.max_seq_len = max_seq_len
        self.checked = bytearray(len(self.entries))  # 1 where this run has compared the sample's checksums

    def __len__(self) -> int:
        return len(self.entries)

    def lengths(self) -> list[int]:
        return [min(int(entry["num_tokens"]), self.max_seq_len) for entry in self.entries]

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        from eagle3_pipeline.formats.hidden_states import load_sample

        if not self.checked[position]:
            check_sample_files(self.data_dir, self.entries[position])
            self.checked[position] = 1  # (a loader worker's own copy: mark_checked tells the main process)
        sample = load_sample(self.data_dir, self.entries[position])
        # aux and final, or FP8 aux with aux_scale, or top-k targets (eagle3_pipeline.formats.storage)
        return {key: value[: self.max_seq_len] for key, value in sample.items()}

    def mark_checked(self, positions: Iterable[int]) -> None:
        """Positions a loader has read (and its workers checked): the next loaders read them unchecked."""
        for position in positions:
            self.checked[position] = 1


def check_sample_files(data_dir: str | Path, entry: dict) -> None:
    """StageFailure when a sample's files are not those stage 02 wrote (size or CRC32 other than recorded), naming
    the sample and the commands that find and redo damaged samples. Reads every byte of them once."""
    from eagle3_pipeline.formats.hidden_states import repair_command, verify_sample

    folder = Path(data_dir) / entry["path"]
    problems = verify_sample(folder)
    if problems:
        raise StageFailure(f"sample {entry.get('id')!r} ({folder}): {'; '.join(problems)}. Its files changed after "
                           f"stage 02 wrote them: find and redo the damaged samples with {repair_command(data_dir)}")


def read_batches(loader: DataLoader) -> Iterator[dict]:
    """The loader's batches (its workers start now). A StageFailure raised in a worker comes back with the worker's
    traceback in its message: it is raised again with the message alone."""
    batches = iter(loader)

    def unwrapped() -> Iterator[dict]:
        try:
            yield from batches
        except StageFailure as err:
            text = str(err)
            marker = f"{StageFailure.__name__}: "
            if "Original Traceback" not in text or marker not in text:
                raise
            raise StageFailure(text[text.rfind(marker) + len(marker):].strip()) from None
    return unwrapped()


def sequences_for_min_steps(lengths: Sequence[int], max_tokens: int, max_sequences: int, epochs: int,
                            micro_per_step: int, min_steps: int, seed: int, pad_to: int = 1) -> int:
    """The most sequences a micro-batch may hold so that `epochs` of the plan give about `min_steps` optimizer
    steps or more: `max_sequences` when its plan already does, else fewer (one at least, whatever that gives)."""
    if min_steps <= 0 or not lengths:
        return max_sequences
    plan = plan_batches(lengths, max_tokens, max_sequences, seed, 0, pad_to=pad_to)
    if epochs * steps_in_epoch(len(plan), micro_per_step) >= min_steps:
        return max_sequences
    return max(1, min(max_sequences, len(lengths) * epochs // (min_steps * micro_per_step)))


def batch_length_multiple(pad_batches_to: int, fp8: bool) -> int:
    """What a batch's length is rounded up to: --pad-batches-to, so that batch shapes repeat and the host's
    per-shape work (cuBLAS's kernel choice) is done once per shape, not once per step; FP8 GEMMs also need
    multiples of FP8_ALIGN."""
    return math.lcm(pad_batches_to, FP8_ALIGN) if fp8 else pad_batches_to


def collate(samples: Sequence[dict[str, torch.Tensor]], pad_to: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into the batch ttt_loss takes; attention_mask is 1 on real tokens.
    The length is rounded up to a multiple of `pad_to` (FP8 GEMMs need multiples of 16)."""
    longest = round_up(max(int(s["input_ids"].shape[0]) for s in samples), pad_to)
    count = len(samples)
    first = samples[0]
    batch = {
        "input_ids": torch.zeros(count, longest, dtype=torch.long),
        "loss_mask": torch.zeros(count, longest, dtype=torch.long),
        "attention_mask": torch.zeros(count, longest, dtype=torch.long),
    }
    # The per-token tensors (aux, final, or aux_scale, topk_ids, topk_logprobs) stay in the stored dtype (bf16,
    # FP8): they are decoded on the device, which keeps the transfers small.
    stored = [key for key in first if key not in batch]
    for key in stored:
        batch[key] = torch.zeros(count, longest, *first[key].shape[1:], dtype=first[key].dtype)
    for row, sample in enumerate(samples):
        length = int(sample["input_ids"].shape[0])
        batch["input_ids"][row, :length] = sample["input_ids"]
        batch["loss_mask"][row, :length] = sample["loss_mask"].to(torch.long)
        batch["attention_mask"][row, :length] = 1
        for key in stored:
            batch[key][row, :length] = sample[key]
    return batch


def make_loader(dataset: Dataset, batches: Sequence[list[int]], num_workers: int, device: str,
                seed: int, pad_to: int = 1) -> DataLoader:
    """A DataLoader over a fixed batch plan. Its own generator keeps it from drawing on the global RNG,
    which would otherwise make a resumed run's noise differ from an uninterrupted one."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_sampler=list(batches), collate_fn=functools.partial(collate, pad_to=pad_to),
                      num_workers=num_workers,
                      pin_memory=str(device).startswith("cuda"), generator=generator,
                      prefetch_factor=4 if num_workers > 0 else None)


class StoredStates:
    """Where an offline run's states come from: the loader's batches of stage 02's files, as they are; train_step
    and evaluate move them to the device (to_device). eagle3_pipeline.train.online.OnlineStates is the online one."""

    online = False
    steps_per_pass = 1  # optimizer steps whose batches are made ready together

    def step_batches(self, batches: Iterator[dict], steps: Sequence, first: int, device) -> Iterator[tuple]:
        """(plan position after the step, its share, its micro-batches, seconds waited for them) for each of
        `steps` from the `first`-th on; `batches` yields their micro-batches in order."""
        for end, share in steps[first:]:
            waited = time.time()
            group = [next(batches) for _ in share]
            yield end, share, group, time.time() - waited

    @staticmethod
    def complete(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
        """A loader's batch on the device, ready for the drafter (validation)."""
        return to_device(batch, device)


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Move a batch to the device, hidden states in their stored dtype (the drafter casts them itself); FP8
    aux are decoded there, to bfloat16."""
    from eagle3_pipeline.formats.storage import dequantize_batch

    non_blocking = torch.device(device).type == "cuda"
    return dequantize_batch({key: value.to(device, non_blocking=non_blocking) for key, value in batch.items()})
