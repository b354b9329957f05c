"""The "static" and "loop" regeneration engines' batches and KV caches (docs/data.md, "Regeneration engines").

Prompts are left-padded to a multiple of STATIC_WIDTH_STEP, so batches share a few shapes (the compiled
decoding step, its CUDA graphs and the pooled caches go by shape); batches of longer prompts take fewer rows,
by a token budget (static_rows, static_batches); each batch decodes with a transformers StaticCache of its own
width, lent from a pool and reset rather than remade (StaticCachePool).
"""
from __future__ import annotations

import functools
import inspect
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Sequence

# Static-cache prompts are left-padded to a multiple of this, so batches share a few compiled shapes.
STATIC_WIDTH_STEP = 128
# Rows of a narrowed static batch are rounded down to a multiple of this (see static_rows).
STATIC_ROW_STEP = 64


def static_width(length: int) -> int:
    """The width a prompt of `length` tokens is left-padded to in the "static" engine."""
    return -(-length // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP


def static_rows(width: int, batch_size: int, max_new_tokens: int) -> int:
    """Rows of a "static" batch padded to `width`: its cache may hold as many positions as a full batch of
    the shortest prompts, batch_size x (STATIC_WIDTH_STEP + max_new_tokens), so wider batches take fewer rows
    (at least 1, at most batch_size).

    Each width gets one row count, so full batches repeat their shapes (the compiled step, its CUDA graphs
    and the pooled caches go by shape). Narrowed batches of 4 x STATIC_ROW_STEP rows or more are rounded
    down to a multiple of STATIC_ROW_STEP: with a batch size that is a multiple too, the last, partial
    batch of a call of one width is then a multiple as well and repeats from call to call, and matrix
    products get whole tiles. That costs under a fifth of the rows; smaller batches keep every row, as a
    large verifier's decoding step then spends much of its time reading the weights, whatever the rows.
    """
    budget = batch_size * (STATIC_WIDTH_STEP + max_new_tokens)
    rows = min(batch_size, budget // (width + max_new_tokens))
    if 4 * STATIC_ROW_STEP <= rows < batch_size:
        rows -= rows % STATIC_ROW_STEP
    return max(1, rows)


def static_batches(lengths: Sequence[int], batch_size: int, max_new_tokens: int) -> list[list[int]]:
    """The "static" engine's batches of prompts with these token lengths (sorted shortest first, as
    HFResponder sorts them): lists of indices into `lengths`, packed greedily in order, each batch as long
    as static_rows allows for its padded width."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0  # of the prompts in `batch`
    for index, length in enumerate(lengths):
        width = static_width(max(longest, length))
        if batch and len(batch) + 1 > static_rows(width, batch_size, max_new_tokens):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(index)
        longest = max(longest, length)
    if batch:
        batches.append(batch)
    return batches


@functools.cache
def generate_cache_keyword() -> str:
    """The `generate` keyword for a cache made by the caller: `past_key_values` in transformers 5.17, `cache`
    in later 5.x (which still takes the old name, with a FutureWarning). Read from the signature of
    generate's own input preparation, which names the cache the way generate's keywords do."""
    from transformers import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class StaticCachePool:
    """transformers StaticCaches kept for reuse between batches and calls, keyed by (rows, width) per device.

    `generate(cache_implementation="static")` makes its own cache, as wide as the widest one it made before
    for that model (transformers keeps `max(max_cache_len, model._previous_max_cache_length)`), so after one
    batch of long prompts every later batch decoded over the long width. A cache passed to `generate` is
    used as it is. Reusing the same cache objects (reset, not remade) keeps the tensor addresses that the
    compiled decoding step's CUDA graphs were recorded with; new addresses make torch record them again,
    and it gives up graphs for a function after `cudagraph_unexpected_rerecord_limit` re-recordings.

    At most `per_device` caches per device are kept, the least recently used dropped: each holds at most one
    batch's token budget (static_rows), and with prompts sorted shortest first the widths of a call come
    in ascending order, so the last two shapes are the ones reused. A cache is lent to one batch at a time
    (copies of the verifier on one device, each in its own thread, get caches of their own). The copies
    on a device must share dtype and head shapes: a cache takes them from the model at its first update.
    """

    def __init__(self, per_device: int = 2):
        self.per_device = per_device
        self.created = 0  # caches made, not reused (the tests check reuse by it)
        self._caches: dict[str, OrderedDict] = {}
        self._lock = threading.Lock()  # several devices' threads borrow caches at once

    @contextmanager
    def lend(self, model, device, rows: int, width: int):
        """An empty StaticCache for `rows` sequences of up to `width` positions on `device`, for the block;
        kept afterwards as the most recently used."""
        from transformers import StaticCache

        key = (rows, width)
        with self._lock:
            caches = self._caches.setdefault(str(device), OrderedDict())
            cache = caches.pop(key, None)  # out of the pool while lent
            if cache is None:
                self.created += 1
        if cache is None:
            cache = StaticCache(config=model.config, max_cache_len=width)
        cache.reset()  # zeroes the keys, values and fill counter in place: the addresses stay
        try:
            yield cache
        finally:
            with self._lock:
                caches[key] = cache
                while len(caches) > self.per_device:
                    caches.popitem(last=False)

    def held(self, device) -> dict:
        """{(rows, width): cache} kept for `device`, least recently used first."""
        with self._lock:
            return dict(self._caches.get(str(device), {}))


@functools.cache
def forward_cache_keyword(model_class: type) -> str:
    """The forward's keyword for the KV cache: `cache` in later transformers 5.x, `past_key_values` before
    (looked up once per model class)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
