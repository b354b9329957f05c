"""Tokenizing a round's records in worker processes, with exactly the per-record results of the serial path.

Stage 01 tokenizes each round between two regenerations, so the GPU waits on it: at 2 ms a conversation a
100K-conversation run spent 100-200 s in one core. A persistent pool of spawned workers (never forked: the parent
holds CUDA and compile threads) each receive the ChatTokenizer once; records go out in slices and come back in
order as plain data, together with the tokenizer's counters, which the parent adds to its own.

submit() hands a round to the pool and returns at once, so the stage can regenerate the next round meanwhile;
collect() waits for it. warm() starts the workers ahead of the first round, from a thread of its own: each
spawned worker imports transformers before it takes its tokenizer, and the parent waits on each in turn (8 took
38 s on the GPU machine), time the stage spends loading the verifier and synthesizing instead.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from threading import BrokenBarrierError
from typing import Union

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.data.chat_tokenizer import ChatTokenizer, Sample
from eagle3_pipeline.data.records import BadRecordError, Record

WORKERS_ENV = "EAGLE3_TOKENIZE_WORKERS"
MAX_DEFAULT_WORKERS = 8      # more buys little: the parent's deduplication and writing then dominate
POOL_MIN_RECORDS = 2000      # fewer records are tokenized in the parent (a pool's start and transfers would not pay)
MAX_SLICE_RECORDS = 256      # records per task
SLICES_PER_WORKER = 4        # smaller slices where a round allows, so no worker idles while one finishes a big one

# One record's result: its samples, or (reason, detail) of the BadRecordError it raised. Plain data, since a
# custom exception does not cross a process boundary intact (BadRecordError unpickles with its message as reason).
Result = Union[list[Sample], tuple[str, str]]
# A submitted round: one future per slice, each giving (results, split_turn_samples added, dropped_turns added).
Tokenizing = list[Future]
WARM_TIMEOUT_S = 300         # a warming task waits this long for the other workers to start


def tokenize_workers() -> tuple[int, bool]:
    """Worker processes from EAGLE3_TOKENIZE_WORKERS (0 or 1: serial), and whether it was set explicitly; unset:
    min(8, cores - 1), leaving a core to the parent."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if not value:
        return min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) - 1), False
    try:
        workers = int(value)
        if workers < 0:
            raise ValueError(value)
    except ValueError:
        raise UsageError(f"{WORKERS_ENV}={value!r}: expected a number of tokenizing processes, e.g. 8 (0 or 1: "
                         "tokenize in the stage's own process)") from None
    return workers, True


def tokenize_one(chat: ChatTokenizer, record: Record) -> Result:
    try:
        return chat.record(record)
    except BadRecordError as err:
        return err.reason, err.detail


# --- in a worker process ------------------------------------------------------------------------------

_chat: ChatTokenizer | None = None  # the worker's copy, set once by the pool's initializer
_started_together = None            # a barrier of all the pool's workers, for warm()


def _start_worker(chat: ChatTokenizer, barrier) -> None:
    global _chat, _started_together
    # One tokenizer thread per worker: the workers are the parallelism, Rayon's threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _chat, _started_together = chat, barrier


def _worker_ready() -> int:
    """warm()'s task: returns once every worker runs one (so each ran its initializer), with this one's pid."""
    try:
        _started_together.wait(WARM_TIMEOUT_S)
    except BrokenBarrierError:  # a worker that never came: the pool reports it on the round's own tasks
        pass
    return os.getpid()


def _tokenize_slice(records: list[Record]) -> tuple[list[Result], int, int]:
    """The slice's results in order, and what it added to split_turn_samples and dropped_turns."""
    split, dropped = _chat.split_turn_samples, _chat.dropped_turns
    results = [tokenize_one(_chat, record) for record in records]
    return results, _chat.split_turn_samples - split, _chat.dropped_turns - dropped


# --- in the stage's process ---------------------------------------------------------------------------

def _start_every_worker(pool: ProcessPoolExecutor, workers: int, started: Future) -> None:
    """warm()'s thread: one task per worker, since each submit spawns a worker while none is idle (a spawn
    waits for the new process to read its tokenizer) and the barrier holds every task until all run, so each
    lands on its own worker. `started` gets their pids, or the error (a pool shut down meanwhile)."""
    try:
        ready = [pool.submit(_worker_ready) for _ in range(workers)]
        started.set_result([future.result() for future in ready])
    except BaseException as error:  # noqa: BLE001 - handed to whoever waits on `started`
        started.set_exception(error)


class ParallelTokenizer:
    """Tokenizes a list of records (ChatTokenizer.record each), in worker processes where that pays."""

    def __init__(self, chat: ChatTokenizer):
        self.chat = chat
        self.workers, explicit = tokenize_workers()
        # Set explicitly, the variable asks for the pool on any round of two records per worker (tests use this).
        self.min_records = 2 * self.workers if explicit else POOL_MIN_RECORDS
        self._pool: ProcessPoolExecutor | None = None

    def pays(self, records: int) -> bool:
        return self.workers > 1 and records >= max(2, self.min_records)

    def __call__(self, records: list[Record]) -> list[Result]:
        return self.collect(self.submit(records))

    def submit(self, records: list[Record]) -> Tokenizing:
        """Hands the records to the pool without waiting; where the pool does not pay, tokenizes them now."""
        if not self.pays(len(records)):
            done: Future = Future()
            # tokenize_one counts into self.chat directly: nothing to add on collect
            done.set_result(([tokenize_one(self.chat, record) for record in records], 0, 0))
            return [done]
        size = max(1, min(MAX_SLICE_RECORDS, math.ceil(len(records) / (SLICES_PER_WORKER * self.workers))))
        pool = self._started()
        return [pool.submit(_tokenize_slice, records[start:start + size]) for start in range(0, len(records), size)]

    def collect(self, tokenizing: Tokenizing) -> list[Result]:
        """The submitted records' results in order; their counters are added to the parent's tokenizer here."""
        results: list[Result] = []
        for future in tokenizing:
            part, split, dropped = future.result()
            results += part
            self.chat.split_turn_samples += split
            self.chat.dropped_turns += dropped
        return results

    def warm(self) -> Future | None:
        """Starts the pool's workers in a thread and returns at once; None where there is no pool (workers <= 1).
        The returned future gives the workers' pids, once every worker has run its initializer."""
        if self.workers <= 1:
            return None
        pool, started = self._started(), Future()
        threading.Thread(target=_start_every_worker, args=(pool, self.workers, started), daemon=True,
                         name="tokenize-warm").start()
        return started

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:
            get_logger().info("tokenizing in %d worker processes (%s)", self.workers, WORKERS_ENV)
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_start_worker,
                                             initargs=(self.chat, context.Barrier(self.workers)))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
