"""Batch packing, the one rule stages 02 and 04 share: sequences of similar length, padded tokens bounded."""
from __future__ import annotations

from typing import Iterable, Sequence


def pack_by_length(order: Iterable[int], lengths: Sequence[int], max_tokens: int,
                   max_sequences: int) -> list[list[int]]:
    """Cut `order` (positions into `lengths`, usually longest first) into consecutive batches.

    A batch holds at most `max_sequences` sequences and at most `max_tokens` padded tokens (sequences x
    longest); a single sequence longer than that gets a batch alone.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for position in order:
        length = int(lengths[position])
        grown = max(longest, length)
        if current and (len(current) >= max_sequences or grown * (len(current) + 1) > max_tokens):
            batches.append(current)
            current, grown = [], length
        current.append(position)
        longest = grown
    if current:
        batches.append(current)
    return batches
