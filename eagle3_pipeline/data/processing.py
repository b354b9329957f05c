"""Stage 01's processing of records in rounds: (regenerate,) tokenize, drop repeated samples, count bad records."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, replace
from itertools import count, islice
from typing import TYPE_CHECKING, Callable, Iterator

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.progress import Progress
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.data.chat_tokenizer import ChatTokenizer, Sample
from eagle3_pipeline.data.parallel_tokenize import ParallelTokenizer, Result, Tokenizing
from eagle3_pipeline.data.records import BadRecordError, BadRecords, Record

if TYPE_CHECKING:
    from eagle3_pipeline.data.regenerate import Regenerator

PREFLIGHT_RECORDS = 200      # conversations rendered before the verifier is loaded for --regenerate
CHUNK_RECORDS = 2048         # records processed (regenerated, tokenized) per round
REGEN_SORT_BATCHES = 32      # with --regenerate a round holds at least this many batches, sorted by length
# (a round is only the unit of sorting and tokenizing: replies are cached per batch, so resuming is unaffected)


# --- before the verifier loads ------------------------------------------------------------------------

def preflight(chat: ChatTokenizer, records: list[Record], limit: float, log) -> None:
    """Render a sample of conversations before the verifier is loaded, so template problems stop early.

    Only template failures count here: missing replies or lengths change once the verifier has replied.
    """
    placeholder = {"role": "assistant", "content": "(reply)"}
    sample = [r for r in islice((r for r in records if r.is_chat), PREFLIGHT_RECORDS)]
    failures = BadRecords()
    for record in sample:
        messages = record.messages if record.messages[-1]["role"] == "assistant" else record.messages + [placeholder]
        try:
            chat.conversation(record.id, messages)
        except BadRecordError as err:
            if err.reason.startswith("template"):
                failures.add(err.reason, record.source, record.line, err.detail, record.id)
    if sample and failures.total / len(sample) > limit:
        failures.log(log, "preflight")
        raise UsageError(f"{failures.total} of the first {len(sample)} conversations cannot be rendered and "
                         f"masked with the chat template ({dict(failures.counts)}), above --max-bad-fraction "
                         f"{limit}; fix the template (--chat-template) or the data before regenerating")


# --- processing: (regenerate,) tokenize, deduplicate --------------------------------------------------

@dataclass
class Pending:
    """A round regenerated and handed to the tokenizer, not yet counted (Processor.start, Processor.finish)."""
    per_record: list[tuple[Record, list[Record]]]  # each record of the chunk with its variants (one per reply)
    inputs: list  # per variant: what it tokenizes (a Record), or its regeneration's failure (reason, detail)
    tokenizing: Tokenizing


class Processor:
    """Turns a chunk of records into accepted (record, samples) pairs; the rest are counted.

    Tokenizing may start worker processes (parallel_tokenize.py): close() it, or use it as a context manager."""

    def __init__(self, chat: ChatTokenizer, bad: BadRecords, regenerate: Regenerator | None = None):
        self.chat, self.bad, self.regenerate = chat, bad, regenerate
        # A batch pads to its longest prompt and the regenerator sorts only within a round, so a round of
        # two large batches puts every long prompt of the round into the second one.
        batch = regenerate.batch_size if regenerate is not None else 0
        self.chunk_records = max(CHUNK_RECORDS, REGEN_SORT_BATCHES * batch)
        self.processed = 0
        self.duplicate_samples = 0
        self._seen: set[bytes] = set()
        self.tokenize = ParallelTokenizer(chat)

    def close(self) -> None:
        self.tokenize.close()

    def __enter__(self) -> Processor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, chunk: list[Record], replies: int = 1,
                 desc: str = "regenerate") -> list[tuple[Record, list[Sample]]]:
        """With a regenerator and `replies` > 1, each conversation gets that many regenerated replies, each
        its own sample (id from reply_id); a reply that fails is counted bad on its own. `desc` names the
        regeneration's progress lines."""
        return self.finish(self.start(chunk, replies, desc))

    def start(self, chunk: list[Record], replies: int = 1, desc: str = "regenerate") -> Pending:
        """Regenerates the chunk (blocking) and hands its tokenizing to the workers without waiting for it."""
        generated = self.regenerate([r for r in chunk if r.is_chat], replies, desc) if self.regenerate else {}
        per_record = [(record, self._variants(record, replies)) for record in chunk]
        # The whole round is tokenized at once (in worker processes where that pays); finish() counts it
        inputs = [self._input(variant, generated) for _, variants in per_record for variant in variants]
        tokenizing = self.tokenize.submit([item for item in inputs if isinstance(item, Record)])
        return Pending(per_record, inputs, tokenizing)

    def finish(self, pending: Pending) -> list[tuple[Record, list[Sample]]]:
        """The round's accepted (record, samples), counted variant by variant in order, so bad records, repeated
        samples and ids come out as if tokenized one by one. Rounds must be finished in the order started."""
        results = iter(self.tokenize.collect(pending.tokenizing))
        inputs_left = iter(pending.inputs)
        accepted = []
        for record, variants in pending.per_record:
            samples = []
            for variant in variants:
                item = next(inputs_left)
                samples += self._samples(variant, next(results) if isinstance(item, Record) else item)
            if samples:
                accepted.append((record, samples))
        return accepted

    def _variants(self, record: Record, replies: int) -> list[Record]:
        if record.is_chat and self.regenerate:
            from eagle3_pipeline.data.regenerate import reply_id

            return [replace(record, id=reply_id(record.id, k)) for k in range(replies)]
        return [record]

    @staticmethod
    def _input(record: Record, generated: dict[str, dict]) -> Record | tuple[str, str]:
        """What a record (or one reply to it) tokenizes: itself, its regenerated conversation, or, when its
        regeneration failed, that failure's (reason, detail)."""
        entry = generated.get(record.id)
        if entry is None:
            return record
        if "bad" in entry:
            return entry["bad"], entry.get("detail", "")
        return replace(record, messages=entry["messages"])

    def _samples(self, record: Record, result: Result) -> list[Sample]:
        """The new samples of one record (or one reply to it); a bad one is counted and gives none."""
        self.processed += 1
        if isinstance(result, tuple):
            reason, detail = result
            self.bad.add(reason, record.source, record.line, detail, record.id)
            return []
        return [s for s in result if self._first_time(s)]

    def _first_time(self, sample: Sample) -> bool:
        """Identical token sequences (e.g. the same prompts regenerated greedily) are kept once."""
        digest = hashlib.sha256(json.dumps(sample.input_ids).encode()).digest()
        if digest in self._seen:
            self.duplicate_samples += 1
            return False
        self._seen.add(digest)
        return True


def fill(candidates: Iterator[Record], need: int | None, process: Processor,
         sink: Callable[[Record, list[Sample]], None], desc: str, replies: int = 1) -> int:
    """Process candidates in order until `need` conversations are accepted (None: all of them), each with
    `replies` regenerated replies.

    Taking all of them while regenerating, a round's tokenizing overlaps the next round's regeneration (the
    GPU does not wait on it); with a number, the next round's size depends on what this one accepted."""
    accepted = 0
    log = get_logger()
    overlap = need is None and process.regenerate is not None
    how = "tokenize"
    if process.regenerate:
        how = "regenerate the replies, then tokenize" + (", each round while the next regenerates" if overlap else "")
    log.info("%s: taking %s conversations, in rounds of up to %d records (%s)", desc,
             need if need is not None else "all remaining", process.chunk_records, how)
    with Progress(total=need, desc=desc, unit="conv") as progress:
        def count_round(pending: Pending) -> int:
            done = process.finish(pending)
            for record, samples in done:
                sink(record, samples)
            progress.update(len(done))  # once a round: a report after the round's first record said "ETA 400 h"
            return len(done)

        previous = None  # with overlap: the round started last, counted once the next one has regenerated
        for round_ in count(1):
            if need is not None and accepted >= need:
                break
            room = process.chunk_records if need is None else min(process.chunk_records, need - accepted)
            chunk = list(islice(candidates, room))
            if not chunk:
                break
            if round_ > 1 and need is not None:
                log.info("%s, round %d: %d more conversation(s), in place of those round %d dropped (%s)", desc,
                         round_, len(chunk), round_ - 1, dropped.reasons())
            dropped = _Dropped(process)
            pending = process.start(chunk, replies, f"regenerate {desc}, round {round_}")
            if not overlap:
                accepted += count_round(pending)
                continue
            if previous is not None:
                accepted += count_round(previous)
            previous = pending
        if previous is not None:
            accepted += count_round(previous)
    return accepted


class _Dropped:
    """What the processor drops from here on (a round): bad records by reason, and repeated samples."""

    def __init__(self, process: Processor):
        self.process = process
        self.bad_before = Counter(process.bad.counts)
        self.duplicates_before = process.duplicate_samples

    def reasons(self) -> str:
        counts = Counter(self.process.bad.counts)
        counts.subtract(self.bad_before)
        duplicates = self.process.duplicate_samples - self.duplicates_before
        if duplicates:
            counts["repeated sample"] = duplicates
        return ", ".join(f"{reason}: {n}" for reason, n in counts.most_common() if n > 0) or "none counted"
