"""Writing stage 01's output: the eval and train splits, the training prompt hashes and the bad-record file."""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from common.cli.errors import UsageError
from common.data.chat_tokenizer import Sample, TokenStats, sample_line
from common.data.inputs import Inputs
from common.data.processing import Processor, fill
from common.data.records import BadRecords, Record, first_user_prompt, prompt_hash, training_prompt_hashes
from common.formats.files import atomic_path, write_text_atomic
from common.formats.manifest import MANIFEST

PROMPT_HASHES_FILE = "train_prompt_hashes.txt"
BAD_RECORDS_FILE = "bad_records.jsonl"


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


# --- bad records --------------------------------------------------------------------------------------

def check_bad_fraction(bad: BadRecords, seen: int, limit: float, what: str, out: Path) -> float:
    """The fraction of `seen` records that are bad; above `limit` a usage error pointing at the bad-record file."""
    fraction = bad.total / seen if seen else 0.0
    if fraction > limit:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in bad.counts.most_common())
        raise UsageError(f"{bad.total} of {seen} records ({100 * fraction:.1f}%) are unusable while {what}, "
                         f"above --max-bad-fraction {limit} ({reasons}; every one is listed with its line in "
                         f"{out / BAD_RECORDS_FILE}). Fix the data, or raise --max-bad-fraction to skip them.")
    return fraction


def write_bad_records(path: Path, reading: BadRecords, processing: BadRecords) -> None:
    """bad_records.jsonl: every unusable record with its phase (reading or processing) and location."""
    lines = [json.dumps({"phase": phase, **entry}, ensure_ascii=False) + "\n"
             for phase, bad in (("reading", reading), ("processing", processing)) for entry in bad.entries]
    write_text_atomic(path, "".join(lines))


# --- the splits ---------------------------------------------------------------------------------------

def remove_previous_output(inputs: Inputs) -> None:
    """--overwrite: every file an earlier run wrote (the regeneration cache is handled on its own)."""
    out = inputs.out
    for stale in (inputs.data_file, inputs.eval_file, out / PROMPT_HASHES_FILE, out / BAD_RECORDS_FILE,
                  out / MANIFEST):
        stale.unlink(missing_ok=True)


def write_splits(args, inputs: Inputs, records: list[Record], process: Processor, reading_bad: BadRecords,
                 n_train: int | None, n_eval: int, log) -> Written:
    """Eval conversations first (chat only), then training ones whose first prompt is not an eval prompt.

    Both files are written to temporary names and renamed only when everything succeeded.
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
                                           args.replies_per_prompt)
        process.bad.log(log, "processing")
        write_bad_records(inputs.out / BAD_RECORDS_FILE, reading_bad, process.bad)
        written.processing_fraction = check_bad_fraction(process.bad, process.processed, args.max_bad_fraction,
                                                          "rendering/tokenizing", inputs.out)
        if not written.train.lengths:
            raise UsageError("no training sample was produced; see the bad-record counts above")
        write_text_atomic(inputs.out / PROMPT_HASHES_FILE,
                          "".join(h + "\n" for h in sorted(written.train_prompt_hashes)))
        # leaving the block renames the finished files into place
    return written
