#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 drafter on the verifier's hidden states, stored by stage 02 or (--online) computed here.

Checks first that the hidden states (stage 02), the vocabulary map (stage 03), the verifier (--model-path,
never loaded offline: only its embed_tokens and lm_head are read) and a --finetune-from drafter fit together, then
trains with AdamW, periodic validation and SGLang-ready checkpoints; --resume continues a stopped run exactly.
With --online the verifier loads here instead and computes each batch's states from stage 01's --prepared-data
(no stage 02, nothing on disk but checkpoints: docs/online.md). Under torchrun it trains data-parallel (DDP, or
FSDP with --fsdp), each rank with its own verifier when online. See docs/training.md.
"""
from __future__ import annotations

import sys

from eagle3_pipeline.errors import report_missing_packages  # noqa: E402

report_missing_packages()  # a missing package: one line naming it and the setup command

from eagle3_pipeline.cli.parser import parse_stage_args
from eagle3_pipeline.cli.stage import run_stage
from eagle3_pipeline.train.inputs import (STAGE, apply_min_steps, check_disk, check_fp8, check_inputs, check_output,
    rank_device, resolve_machine_defaults, run_config_of)


def parse(argv):
    """The flags, with the defaults that depend on the machine resolved (run_pipeline.py parses them so too)."""
    return resolve_machine_defaults(parse_stage_args(STAGE, __doc__, argv))


def work(args, log, hooks=()):
    from eagle3_pipeline import distributed
    from eagle3_pipeline.train.checkpoints import CheckpointManager
    from eagle3_pipeline.train.run import count_parameters, train_drafter

    rank = distributed.rank_info()
    # Every rank checks everything (read-only), so a bad input stops all of them with exit code 2.
    inputs = check_inputs(args, log)
    apply_min_steps(args, inputs, rank.world_size, log)
    run_config = run_config_of(args, inputs, rank.world_size)
    resume_from, clear_first = check_output(args, run_config, log)
    check_disk(args, count_parameters(inputs), log)
    device = rank_device(args, rank)
    check_fp8(args, device)
    if args.fsdp and not rank.distributed:
        log.warning("--fsdp shards over the ranks of a torchrun launch; this single process trains as usual")
    with distributed.process_group("cuda" if device.startswith("cuda") else "cpu") as rank:
        distributed.barrier()  # every rank has read the output folder before rank 0 changes it
        if clear_first and rank.is_main:  # only now that every check has passed
            log.info("removing the earlier run's checkpoints and metrics in %s", args.output_dir)
            CheckpointManager(args.output_dir, args.keep_last).clear()
        train_drafter(args, log, inputs, run_config, resume_from, device, rank, hooks)
        distributed.barrier()  # rank 0 has written its last checkpoint and the manifest


def inputs_read(args):
    """The other stages' outputs this run reads (eagle3_pipeline/cli/stage.py holds them against an --overwrite)."""
    return ("prepared_data" if args.online else "data_dir", "vocab_mapping_dir")


def main(argv=None, hooks=()) -> int:
    """`hooks` (in-process callers only): called as hook(trainer) after every optimizer step."""
    return run_stage(STAGE, parse, lambda args, log: work(args, log, hooks), argv, reads=inputs_read)


if __name__ == "__main__":
    sys.exit(main())
