"""Stage 02's batches: the length-sorted plan, each rank's share of it, padded inputs and the real-token gather."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from eagle3_pipeline.batching import pack_by_length
from eagle3_pipeline.formats.prepared_data import Sample

PAD_TOKEN_ID = 0  # right padding under a causal mask is never attended to, so any valid id works


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
    from eagle3_pipeline.distributed import share_by_cost

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
