"""Stage 01 after its input checks: read the data, regenerate if asked, write the splits and the manifest."""
from __future__ import annotations

import math
import random
from dataclasses import replace

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.run_layout import PREPARED_DATA_FILE
from eagle3_pipeline.data.chat_tokenizer import LOSS_MASK_CONVENTION, ChatTokenizer, end_of_turn_ids
from eagle3_pipeline.data.config import PrepareConfig
from eagle3_pipeline.data.inputs import STAGE, Inputs, generator_identity
from eagle3_pipeline.data.processing import Processor, preflight
from eagle3_pipeline.data.records import (BadRecords, Record, drop_prompts, keep_first_user_turns, make_ids_unique,
                                          remove_duplicates)
from eagle3_pipeline.data.sources import read_records
from eagle3_pipeline.data.synthesis import SOURCE, synthesize
from eagle3_pipeline.data.splits import (BAD_RECORDS_FILE, PROMPT_HASHES_FILE, REFUSED_BAD_RECORDS_FILE,
                                         check_bad_fraction, write_bad_records, write_splits)
from eagle3_pipeline.formats.manifest import Manifest

DEFAULT_REGEN_BATCH = 16


# --- reading and regenerating -------------------------------------------------------------------------

def regeneration_cache(config: PrepareConfig, inputs: Inputs, log):
    """The resumable cache of generated conversations.

    Responses made with the same generation settings (verifier, template, max tokens, temperature,
    dtype) are reused even under --overwrite, so asking for more samples does not pay for the old ones
    again; a cache made with other settings is refused, or under --overwrite removed once the new data has
    passed its checks (discard_outdated_cache).
    """
    from eagle3_pipeline.data.regenerate import RegenerationCache

    settings = {k: inputs.fingerprint[k] for k in ("model_path", "tokenizer_sha256", "chat_template_sha256",
                                                   "max_seq_len")}
    regeneration = config.regeneration
    settings.update(max_new_tokens=regeneration.max_new_tokens, temperature=regeneration.temperature,
                    seed=config.seed if regeneration.temperature > 0 else None,
                    **generator_identity(config, inputs.served_model))
    if regeneration.greedy_first_reply:  # only then, so caches made before the flag stay usable
        settings["greedy_first_reply"] = True
    cache = RegenerationCache(inputs.out, settings)
    if regeneration.enabled and not (config.outputs.overwrite and cache.differences()):
        cache.check_settings()
        if cache.path.exists():
            log.info("responses already in %s are reused (same generation settings); delete that file to "
                     "generate them again", cache.path)
    return cache


def discard_outdated_cache(overwrite: bool, cache, log) -> None:
    """--overwrite: a cache generated with other settings goes, once the new data has passed its checks."""
    if overwrite and cache.differences():
        log.info("--overwrite: removing %s (generated with other settings)", cache.path)
        cache.remove()


def read_data(config: PrepareConfig, inputs: Inputs, log) -> tuple[list[Record], BadRecords, list[dict], int]:
    """Every usable record (streamed from each source), the bad ones, the sources as described, and how many
    records were read; refuses data with too few usable records (an earlier output is left as it was)."""
    bad = BadRecords()
    described: list[dict] = []

    def source_done(source, good, failed):
        log.info("read %s: %d usable record(s), %d unusable", source.spec, good, failed)
        described.append({**source.describe(), "records": good, "bad_records": failed})

    records = read_records(inputs.sources, bad, source_done)
    records_read = len(records) + bad.total
    data = config.data
    if data.max_turns:
        records = [replace(r, messages=keep_first_user_turns(r.messages, data.max_turns)) if r.is_chat else r
                   for r in records]
    bad.log(log, "reading")
    try:
        if not records:
            raise UsageError(f"--dataset {' '.join(data.datasets)}: no usable record among {records_read}; each "
                             "record needs conversations (from/value), messages (role/content) or text")
        check_bad_fraction(bad, records_read, data.max_bad_fraction, "reading", inputs.out)
    except UsageError:
        write_bad_records(inputs.out / REFUSED_BAD_RECORDS_FILE, bad, BadRecords())
        raise
    if any(r.is_chat for r in records) and inputs.fingerprint["chat_template_sha256"] is None:
        raise UsageError(f"--model-path {config.verifier.model_path}: its tokenizer has no chat template, and the "
                         "data has conversations; give --chat-template FILE (a Jinja template)")
    return records, bad, described, records_read


def make_regenerator(config: PrepareConfig, inputs: Inputs, stop_ids: set[int], cache, records: list[Record], log):
    """The verifier-backed regenerator (the model loads on first use, after the preflight), or the
    endpoint-backed one with --regenerate-endpoint (no model load here)."""
    from eagle3_pipeline.data.regenerate import Regenerator
    from eagle3_pipeline.data.responders import EndpointResponder, HFResponder
    from eagle3_pipeline.verifier.loading import load_verifier_model, regeneration_placement

    data, regeneration, verifier = config.data, config.regeneration, config.verifier
    preflight(ChatTokenizer(inputs.tokenizer, stop_ids, data.max_seq_len), records, data.max_bad_fraction, log)
    if regeneration.endpoint:
        # conversations per cache append: enough to keep every concurrent request slot busy
        batch_size = regeneration.batch_size or max(DEFAULT_REGEN_BATCH, 4 * regeneration.concurrency)
        log.info("regenerating through %s (model %s, %d request(s) in flight)", regeneration.endpoint,
                 inputs.served_model or "default", regeneration.concurrency)
        responder = EndpointResponder(regeneration.endpoint, inputs.served_model, regeneration.max_new_tokens,
                                      regeneration.temperature, regeneration.concurrency)
        return Regenerator(responder, cache, batch_size, regeneration.greedy_first_reply)
    batch_size = regeneration.batch_size or DEFAULT_REGEN_BATCH
    devices, device_map = regeneration_placement(verifier.model_path, inputs.device, verifier.device_map)
    responder = HFResponder(
        lambda device: load_verifier_model(verifier.model_path, device, verifier.dtype, verifier.trust_remote_code,
                                           device_map),
        inputs.tokenizer, stop_ids, regeneration.max_new_tokens, regeneration.temperature, batch_size,
        data.max_seq_len, config.seed, devices, regeneration.engine)
    return Regenerator(responder, cache, batch_size, regeneration.greedy_first_reply)


def warn_of_merged_prompts(records: list[Record], log) -> None:
    """A reply is regenerated after each run of prompts: say so where two user turns follow each other."""
    from eagle3_pipeline.data.regenerate import answers_several_prompts_at_once

    merged = [r for r in records if r.is_chat and answers_several_prompts_at_once(r.messages)]
    if merged:
        log.warning("%d conversation(s) have two user turns in a row (e.g. %s, %s line %d): each such run gets one "
                    "regenerated reply, after its last turn. To answer every turn, keep an assistant turn between "
                    "them in the data (any text: --regenerate replaces it)", len(merged), merged[0].id,
                    merged[0].source, merged[0].line)


def warn_of_fewer_samples(num_samples: int | None, written, records_read: int, log) -> None:
    """--num-samples asked for more conversations than the data gave: say so, with where the rest went."""
    taken = written.train_conversations + written.eval_conversations
    if num_samples and taken < num_samples:
        log.warning("--num-samples %d: the data gave only %d usable conversation(s) (of %d record(s) read: the "
                    "rest are duplicates, excluded or bad records, counted below); all of them were taken",
                    num_samples, taken, records_read)


def take_per_source(config: PrepareConfig, records: list[Record], log) -> tuple[list[Record], dict | None]:
    """--source-count: N records of each named source, a sample seeded by --seed and the source's name (so
    naming another source changes nothing here); the others kept whole, in order. Returns the counts too."""
    from eagle3_pipeline.data.inputs import source_counts

    wanted = source_counts(config.data, config.synthesis)
    if not wanted:
        return records, None
    chosen: set[int] = set()
    mixing = {}
    for source, count in wanted.items():
        pool = [i for i, r in enumerate(records) if r.source == source]
        random.Random(f"{config.seed}:{source}").shuffle(pool)
        chosen.update(pool[:count])
        mixing[source] = {"asked": count, "available": len(pool), "taken": min(count, len(pool))}
        log.info("--source-count: %s: %d of its %d usable conversation(s) taken (%d asked)", source,
                 mixing[source]["taken"], len(pool), count)
        if len(pool) < count:
            log.warning("--source-count %s=%d: the source gave only %d usable conversation(s); all were taken",
                        source, count, len(pool))
    return [r for i, r in enumerate(records) if r.source not in wanted or i in chosen], mixing


# --- the stage's work ---------------------------------------------------------------------------------

def choose_records(config: PrepareConfig, inputs: Inputs, records: list[Record], log):
    """The records the splits draw from, in their shuffled order, with what was dropped on the way and the
    split sizes: (records, duplicates, excluded, mixing, n_train, n_eval); n_train None takes every remaining."""
    data = config.data
    records, duplicates = remove_duplicates(records)
    records, excluded = drop_prompts(records, inputs.excluded_prompts)
    if data.exclude_prompts:
        log.info("--exclude-prompts: %d conversation(s) dropped whose first prompt is in %s", excluded,
                 ", ".join(data.exclude_prompts))
    records, mixing = take_per_source(config, records, log)
    make_ids_unique(records)
    random.Random(config.seed).shuffle(records)
    total = min(data.num_samples or len(records), len(records))
    n_eval = max(1, round(total * data.eval_ratio)) if data.eval_ratio > 0 and total >= 2 else 0
    n_train = total - n_eval if data.num_samples else None  # None: every remaining record
    log.info("%d usable record(s) after removing %d exact duplicate(s); taking %s for training and %d for "
             "evaluation", len(records), duplicates, n_train if n_train is not None else "the rest", n_eval)
    return records, duplicates, excluded, mixing, n_train, n_eval


def start_manifest(config: PrepareConfig, inputs: Inputs, described: list[dict]) -> Manifest:
    manifest = Manifest(inputs.out, STAGE, config.flags)
    manifest.data.update(fingerprint=inputs.fingerprint, verifier=inputs.verifier_identity,
                         chat_template_sha256=inputs.template_sha, sources=described,
                         loss_mask_convention=LOSS_MASK_CONVENTION)
    if config.verifier.chat_template:
        manifest.add_input("chat_template", config.verifier.chat_template)
    if not manifest.path.exists():  # an earlier run's manifest stays until its output is replaced
        manifest.write()
    return manifest


def prepare_data(config: PrepareConfig, inputs: Inputs, log) -> dict:
    """Everything stage 01 does once its inputs are checked; returns the completed manifest's data."""
    from eagle3_pipeline.verifier.loading import resolve_model_path

    data, regeneration = config.data, config.regeneration
    cache = regeneration_cache(config, inputs, log)
    records, reading_bad, described, records_read = read_data(config, inputs, log) if data.datasets \
        else ([], BadRecords(), [], 0)
    stop_ids = end_of_turn_ids(inputs.tokenizer, resolve_model_path(config.verifier.model_path)[0])
    chat = ChatTokenizer(inputs.tokenizer, stop_ids, data.max_seq_len)
    regenerator = make_regenerator(config, inputs, stop_ids, cache, records, log) if regeneration.enabled else None
    discard_outdated_cache(config.outputs.overwrite, cache, log)  # the new data passed its checks (and the preflight)

    with Processor(chat, BadRecords(), regenerator) as process:  # stops its tokenizing processes, also on errors
        # Records (or replies) enough for the pool: its workers start while synthesis and the first round run on
        # the GPU, not once the first round waits for them
        expected = min(data.num_samples or math.inf, len(records) + (config.synthesis.count or 0))
        if regenerator is not None and process.tokenize.pays(expected * regeneration.replies_per_prompt):
            process.tokenize.warm()
        synthesis = None
        if config.synthesis.count:
            made, synthesis = synthesize(config, inputs, regenerator, cache, stop_ids, log)
            described.insert(0, {"dataset": SOURCE, "format": "synthesize", "records": len(made), "bad_records": 0})
            records, records_read = made + records, records_read + len(made)

        records, duplicates, excluded, mixing, n_train, n_eval = choose_records(config, inputs, records, log)
        if regenerator is not None:
            warn_of_merged_prompts(records, log)
        manifest = start_manifest(config, inputs, described)
        written = write_splits(inputs, records, process, reading_bad, records_read, n_train, n_eval, log,
                               replies_per_prompt=regeneration.replies_per_prompt,
                               max_bad_fraction=data.max_bad_fraction, before_replacing=manifest.write)
    warn_of_fewer_samples(data.num_samples, written, records_read, log)

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
        "records_read": records_read, "duplicates_removed": duplicates,
        "excluded_prompt_conversations": excluded,
        "duplicate_samples_removed": process.duplicate_samples,
        "eval_prompt_overlap_dropped": written.eval_prompt_overlap_dropped, "bad_records": all_bad.total,
        "split_turn_samples": chat.split_turn_samples, "dropped_turns": chat.dropped_turns,
    }
    manifest.data["token_stats"] = {"train": train, "eval": held_out}
    manifest.data["bad_records"] = {**all_bad.summary(), "file": BAD_RECORDS_FILE,
                                    "fraction": {"reading": round(reading_bad.total / records_read, 5),
                                                 "processing": round(written.processing_fraction, 5),
                                                 "unusable": round(written.unusable_fraction, 5)},
                                    "max_bad_fraction": data.max_bad_fraction}
    manifest.data["outputs"] = {"train": PREPARED_DATA_FILE,
                                "eval": str(inputs.eval_file.resolve()) if n_eval else None}
    manifest.data["train_prompt_hashes"] = {"file": PROMPT_HASHES_FILE, "count": len(written.train_prompt_hashes),
                                            "normalisation": "whitespace collapsed, lowercased, sha256 "
                                                             "(eagle3_pipeline.data.records.prompt_hash) "
                                                             "of each chat's first prompt and of each text's "
                                                             "text_prompt_hashes"}
    if regenerator is not None:
        manifest.data["regeneration"] = {"settings": cache.settings, "cache": cache.path.name, **regenerator.counts,
                                         "hit_max_new_tokens": regenerator.respond.hit_max_new_tokens,
                                         "replies_per_prompt": regeneration.replies_per_prompt,
                                         "engine": None if regeneration.endpoint else regenerator.respond.engine}
        if regeneration.endpoint:  # requests that failed after retries (their conversations are bad records)
            manifest.data["regeneration"].update(failures=regenerator.respond.failures,
                                                 failure_examples=regenerator.respond.errors)
        else:  # where the run's time went: inside the verifier's batches, against the stage's wall time
            manifest.data["regeneration"]["engine_batches"] = regenerator.respond.batch_totals()
    if synthesis is not None:
        manifest.data["synthesis"] = synthesis
    if mixing is not None:
        manifest.data["mixing"] = mixing
    manifest.complete()
    return manifest.data
