#!/usr/bin/env python3
"""Stage 03: build the draft vocabulary from the loss-masked tokens of the prepared data.

Counts how often each verifier token is a training target, keeps the --draft-vocab-size most frequent
(ties by token id; the identity map when the verifier vocabulary is not larger), and writes
vocab_mapping.safetensors (d2t int64 offsets, t2d bool mask, as SGLang loads them), vocab_report.json
(coverage, unique tokens, least frequent kept token) and manifest.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

from eagle3_pipeline.errors import report_missing_packages  # noqa: E402

report_missing_packages()  # a missing package: one line naming it and the setup command

from eagle3_pipeline.errors import UsageError, require
from eagle3_pipeline.cli.parser import parse_stage_args
from eagle3_pipeline.progress import Progress
from eagle3_pipeline.cli.stage import run_stage
from eagle3_pipeline.formats.files import sha256_file, write_json_atomic
from eagle3_pipeline.formats.manifest import MANIFEST, STATUS_COMPLETE, Manifest, check_verifier_matches, load_manifest
from eagle3_pipeline.formats.prepared_data import iter_prepared_data
from eagle3_pipeline.formats.resume import earlier_manifest, refuse_other_settings, setting_differences
from eagle3_pipeline.formats.vocab_map import (REPORT_FILE, count_target_tokens, mapping_report, save_mapping,
                                               select_draft_vocab)
from eagle3_pipeline.verifier.loading import load_tokenizer, read_verifier_info

STAGE = "03_build_vocab_mapping"


def parse(argv):
    return parse_stage_args(STAGE, __doc__, argv)


def check_inputs(args, log):
    require(args, "prepared_data")
    data_path = Path(args.prepared_data)
    if not data_path.is_file():
        raise UsageError(f"--prepared-data {data_path}: no such file; run 01_prepare_data.py first")
    data_manifest = load_manifest(data_path.parent, "01_prepare_data", "--prepared-data")
    verifier = data_manifest.get("verifier", {})
    tokenizer = None
    if args.model_path:
        info = read_verifier_info(args.model_path, args.trust_remote_code)
        check_verifier_matches(data_manifest, f"{data_path.parent / MANIFEST}", info.identity(),
                               f"--model-path {args.model_path}")
        verifier = info.identity()
        tokenizer = load_tokenizer(args.model_path, args.trust_remote_code)
    if not verifier.get("vocab_size"):
        raise UsageError(f"{data_path.parent / MANIFEST} records no verifier vocab_size; rerun 01_prepare_data.py")
    return data_path, data_manifest, verifier, tokenizer


def already_done(output_dir: Path, data_path: Path, draft_vocab_size: int) -> bool:
    """True when the same mapping exists; refuse to replace a different one without --overwrite."""
    previous = earlier_manifest(output_dir, STAGE, overwrite=False)
    if previous is None or previous.get("status") != STATUS_COMPLETE:
        return False
    upstream = previous.get("inputs", {}).get("prepared_data", {})
    recorded = {"prepared_data_manifest_sha256": upstream.get("manifest_sha256"),
                "draft_vocab_size": previous.get("draft_vocab_size_requested")}
    wanted = {"prepared_data_manifest_sha256": sha256_file(data_path.parent / MANIFEST),
              "draft_vocab_size": draft_vocab_size}
    refuse_other_settings(f"{output_dir} already holds a vocabulary map", setting_differences(recorded, wanted),
                          "Pass --overwrite to replace it (checkpoints trained on the old map will then be refused), "
                          "or choose another --output-dir")
    return True


def work(args, log):
    data_path, data_manifest, verifier, tokenizer = check_inputs(args, log)
    output_dir = Path(args.output_dir)
    if not args.overwrite and already_done(output_dir, data_path, args.draft_vocab_size):
        log.info("%s already holds this vocabulary map; nothing to do (--overwrite to rebuild)", output_dir)
        return

    manifest = Manifest(output_dir, STAGE, vars(args))
    manifest.add_input("prepared_data", data_path, data_path.parent / MANIFEST)
    manifest.data["verifier"] = verifier

    vocab_size = int(verifier["vocab_size"])
    total = data_manifest.get("counts", {}).get("samples")
    with Progress(total, "counting target tokens", unit="samples") as progress:
        def records():  # whole samples (no --max-seq-len cut): every target stage 01 wrote counts
            for sample in iter_prepared_data(data_path, vocab_size):
                progress.update()
                yield {"input_ids": sample.input_ids.numpy(), "loss_mask": sample.loss_mask.numpy()}
        counts = count_target_tokens(records(), vocab_size, source=str(data_path))

    mapping = select_draft_vocab(counts, args.draft_vocab_size)
    report = mapping_report(counts, mapping, tokenizer)
    if report["target_tokens"] == 0:
        raise UsageError(f"{data_path}: no loss-masked tokens at all; check stage 01's output")

    # Every input is read and checked: only now is an earlier map replaced (its manifest says running first).
    manifest.write()
    save_mapping(mapping, output_dir)
    write_json_atomic(output_dir / REPORT_FILE, report)

    manifest.data.update(draft_vocab_size=report["draft_vocab_size"], vocab_size=vocab_size,
                         draft_vocab_size_requested=args.draft_vocab_size)
    manifest.data["counts"] = {k: report[k] for k in ("target_tokens", "unique_target_tokens")}
    manifest.data["coverage"] = report["coverage"]
    manifest.complete()
    log.info("draft vocabulary %d of %d tokens covers %.2f%% of %d training targets (%d unique seen); "
             "least frequent kept: %s", report["draft_vocab_size"], vocab_size, 100 * report["coverage"],
             report["target_tokens"], report["unique_target_tokens"], report["least_frequent_kept"])
    if report["draft_vocab_size"] < args.draft_vocab_size:
        log.info("the verifier vocabulary (%d) is not larger than --draft-vocab-size %d: identity map",
                 vocab_size, args.draft_vocab_size)
    log.info("wrote %s", output_dir)


def main(argv=None) -> int:
    return run_stage(STAGE, parse, work, argv, reads=lambda args: ("prepared_data",))


if __name__ == "__main__":
    sys.exit(main())
