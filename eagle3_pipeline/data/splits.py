"""Writing stage 01's output: the eval and train splits, the training prompt hashes and the bad-record file."""
from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.data.chat_tokenizer import Sample, TokenStats, sample_line
from eagle3_pipeline.data.inputs import Inputs
from eagle3_pipeline.data.processing import Processor, fill
from eagle3_pipeline.data.records import BadRecords, Record, first_user_prompt, prompt_hash, training_prompt_hashes
from eagle3_pipeline.formats.files import atomic_path, write_text_atomic

PROMPT_HASHES_FILE = "train_prompt_hashes.txt"
BAD_RECORDS_FILE = "bad_records.jsonl"
REFUSED_BAD_RECORDS_FILE = "bad_records.refused.jsonl"  # a refused run's list: the output's own list stays


@dataclass
class Written:
    """What the split-writing step produced."""
    train: TokenStats = field(default_factory=TokenStats)
    eval: TokenStats = field(default_factory=TokenStats)
    train_conversations: int = 0
    eval_conversations: int = 0
    train_prompt_hashes: set = field(default_factory=set)
    eval_prompt_overlap_dropped: int = 0
    processing_fraction: float = 0.0
    unusable_fraction: float = 0.0


# --- bad records --------------------------------------------------------------------------------------

def check_bad_fraction(bad: BadRecords, seen: int, limit: float, what: str, out: Path) -> float:
    """The fraction of `seen` records that are bad; above `limit` a usage error pointing at the refused run's list."""
    fraction = bad.total / seen if seen else 0.0
    if fraction > limit:
        raise UsageError(f"{bad.total} of {seen} records ({100 * fraction:.1f}%) are unusable while {what}, "
                         f"above --max-bad-fraction {limit} ({_reasons(bad.counts)}; {_fix(out)}")
    return fraction


def check_unusable_fraction(reading: BadRecords, records_read: int, processing: BadRecords, processed: int,
                            limit: float, out: Path) -> float:
    """The fraction of records unusable for any reason, read or processed; above `limit` a usage error.

    A record is usable when it reads and then renders (or regenerates); with every record processed this is
    (bad while reading + bad while processing) / records read, and with --num-samples the processed share
    stands for the rest.
    """
    usable = (1 - reading.total / records_read if records_read else 1.0) * \
        (1 - processing.total / processed if processed else 1.0)
    fraction = 1 - usable
    if fraction > limit:
        all_processed = processed + reading.total == records_read
        share = (f"{reading.total + processing.total} of {records_read} records" if all_processed else
                 f"{reading.total} of {records_read} records while reading and {processing.total} of the "
                 f"{processed} processed")
        raise UsageError(f"{100 * fraction:.1f}% of the records are unusable ({share}), above --max-bad-fraction "
                         f"{limit} ({_reasons(reading.counts + processing.counts)}; {_fix(out)}")
    return fraction


def _reasons(counts: Counter) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in counts.most_common())


def _fix(out: Path) -> str:
    return (f"every one is listed with its line in {out / REFUSED_BAD_RECORDS_FILE}). Fix the data, or raise "
            f"--max-bad-fraction to skip them. Any earlier output in {out} is kept as it was.")


def write_bad_records(path: Path, reading: BadRecords, processing: BadRecords) -> None:
    """bad_records.jsonl: every unusable record with its phase (reading or processing) and location."""
    lines = [json.dumps({"phase": phase, **entry}, ensure_ascii=False) + "\n"
             for phase, bad in (("reading", reading), ("processing", processing)) for entry in bad.entries]
    write_text_atomic(path, "".join(lines))


# --- the splits ---------------------------------------------------------------------------------------

def remove_stale_outputs(inputs: Inputs, wrote_eval: bool) -> None:
    """Once the new output is in place: files of an earlier run that this one did not replace."""
    stale = [inputs.out / REFUSED_BAD_RECORDS_FILE] + ([] if wrote_eval else [inputs.eval_file])
    for path in stale:
        path.unlink(missing_ok=True)


def write_splits(inputs: Inputs, records: list[Record], process: Processor, reading_bad: BadRecords,
                 records_read: int, n_train: int | None, n_eval: int, log, *, replies_per_prompt: int,
                 max_bad_fraction: float, before_replacing: Callable[[], None]) -> Written:
    """Eval conversations first (chat only), then training ones whose first prompt is not an eval prompt.

    Both files are written to temporary names; only once every check has passed is `before_replacing` called
    and are the finished files renamed over an earlier run's, so a refused run leaves that output as it was.
    """
    written = Written()
    eval_hashes: set[str] = set()
    taken_for_eval: set[str] = set()

    def eval_candidates() -> Iterator[Record]:
        for record in records:
            if record.is_chat:  # only conversations have prompts to hold out
                taken_for_eval.add(record.id)
                yield record

    def train_candidates() -> Iterator[Record]:
        for record in records:
            if record.id in taken_for_eval:
                continue
            if record.is_chat and prompt_hash(first_user_prompt(record.messages)) in eval_hashes:
                written.eval_prompt_overlap_dropped += 1
                continue
            yield record

    with ExitStack() as stack:
        def open_atomic(path: Path):
            return stack.enter_context(open(stack.enter_context(atomic_path(path)), "w", encoding="utf-8"))

        eval_handle = open_atomic(inputs.eval_file) if n_eval else None
        train_handle = open_atomic(inputs.data_file)

        def write_eval(record: Record, samples: list[Sample]) -> None:
            prompt = first_user_prompt(record.messages)
            eval_hashes.add(prompt_hash(prompt))
            for sample in samples:
                written.eval.add(sample)
                eval_handle.write(sample_line(sample, {"conversation_id": record.id, "prompt": prompt,
                                                       "messages": record.messages}))

        def write_train(record: Record, samples: list[Sample]) -> None:
            written.train_prompt_hashes.update(training_prompt_hashes(record))
            for sample in samples:
                written.train.add(sample)
                train_handle.write(sample_line(sample))

        if n_eval:
            written.eval_conversations = fill(eval_candidates(), n_eval, process, write_eval, "eval split")
        written.train_conversations = fill(train_candidates(), n_train, process, write_train, "train split",
                                           replies_per_prompt)
        process.bad.log(log, "processing")
        try:
            written.unusable_fraction = check_unusable_fraction(reading_bad, records_read, process.bad,
                                                                process.processed, max_bad_fraction, inputs.out)
            if not written.train.lengths:
                raise UsageError("no training sample was produced; see the bad-record counts above")
        except UsageError:
            write_bad_records(inputs.out / REFUSED_BAD_RECORDS_FILE, reading_bad, process.bad)
            raise
        written.processing_fraction = process.bad.total / process.processed if process.processed else 0.0
        before_replacing()
        write_bad_records(inputs.out / BAD_RECORDS_FILE, reading_bad, process.bad)
        write_text_atomic(inputs.out / PROMPT_HASHES_FILE,
                          "".join(h + "\n" for h in sorted(written.train_prompt_hashes)))
        # leaving the block renames the finished files into place
    remove_stale_outputs(inputs, wrote_eval=bool(n_eval))
    return written
