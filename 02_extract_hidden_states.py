#!/usr/bin/env python
"""Stage 02: run the verifier over the prepared data and store EAGLE-3's training inputs.

For every sample of RUN_DIR/data/tokenized_data.jsonl it writes RUN_DIR/hidden_states/shard_NNNNN/<id>/ with
aux_0/aux_1/aux_2.pt (the residual stream entering the --aux-layers decoder layers), final.pt (after the final
norm) and meta.pt, plus index.jsonl and manifest.json (--aux-dtype float8_e4m3 adds aux_scale.pt; --targets topk
stores topk_ids.pt and topk_logprobs.pt instead of final.pt). Inputs are checked before the verifier loads; a rerun
resumes (redoing samples whose files are not whole), --overwrite starts over, --verify checks every file's
checksum, --rebuild-manifest recovers from a damaged manifest; --backend sglang --tp-size N runs the verifier
in SGLang. Details: docs/extraction.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

from eagle3_pipeline.errors import report_missing_packages  # noqa: E402

report_missing_packages()  # a missing package: one line naming it and the setup command

from eagle3_pipeline.errors import UsageError, require  # noqa: E402
from eagle3_pipeline import distributed  # noqa: E402
from eagle3_pipeline.cli.parser import parse_stage_args  # noqa: E402
from eagle3_pipeline.cli.stage import run_stage  # noqa: E402
from eagle3_pipeline.formats.layer_ids import check_aux_layers, default_aux_layers  # noqa: E402
from eagle3_pipeline.verifier.loading import pick_device, read_verifier_info  # noqa: E402

STAGE = "02_extract_hidden_states"


def parse(argv):
    return parse_stage_args(STAGE, __doc__, argv)


def work(args, log) -> None:
    from eagle3_pipeline.extract.config import ExtractionConfig
    from eagle3_pipeline.extract.run import ExtractionInputs, extract_hidden_states
    from eagle3_pipeline.formats.prepared_data import check_prepared_data

    if args.verify:  # a check of the files already there: no verifier, no prepared data
        from eagle3_pipeline.extract.verify import verify_output

        return verify_output(Path(args.output_dir), log)
    require(args, "model_path", "prepared_data")
    config = ExtractionConfig.from_args(args)  # what the library below takes (the flags stay up here)
    # a checked SGLang release, GPUs, one process: checked first (eagle3_pipeline/verifier/)
    if args.backend == "sglang":
        from eagle3_pipeline.extract.sglang_backend import check_engine_settings, check_sglang_early

        if args.aux_dtype != "bfloat16" or args.targets != "final":
            raise UsageError("--aux-dtype float8_e4m3 and --targets topk are written by the hf backend only (the "
                             "SGLang capture in patches/sglang_capture.py stores --dtype aux and final): drop them "
                             "or use --backend hf")

        version = check_sglang_early(config)
        check_engine_settings(config.sglang, version)
    elif args.tp_size != 1:
        log.warning("--tp-size %d is for the sglang backend; the hf backend places the verifier with --device-map",
                    args.tp_size)
    if args.backend != "sglang" and (args.attention_backend or args.sampling_backend or args.sglang_arg):
        log.warning("--attention-backend, --sampling-backend and --sglang-arg are SGLang's engine settings; the hf "
                    "backend ignores them")

    # Under torchrun, each rank owns a disjoint group of its node's GPUs (CUDA_VISIBLE_DEVICES, set before CUDA
    # starts) and extracts a share of the batches; the ranks only coordinate, through gloo.
    rank = distributed.rank_info()
    if args.device != "cpu":
        distributed.restrict_gpus_to_local_rank(rank)
    distributed.init("cpu", distributed.EXTRACTION_TIMEOUT)

    # 1. The verifier's config and tokenizer (seconds, no weights).
    info = read_verifier_info(args.model_path, args.trust_remote_code)
    aux_layers = check_aux_layers(list(args.aux_layers) if args.aux_layers else default_aux_layers(info.num_layers),
                                  info.num_layers)
    if args.backend == "sglang":
        from eagle3_pipeline.extract.sglang_backend import check_sglang_verifier

        check_sglang_verifier(config.verifier.model_path, info, aux_layers)
    device = pick_device(args.device)
    compute_dtype = args.dtype if device != "cpu" else "float32"
    log.info("verifier %s: %s, %d layers, hidden %d, vocab %d; aux layers %s (inputs of those decoder layers = "
             "output_hidden_states indices); stored as %s, computed in %s on %s", args.model_path,
             info.architecture, info.num_layers, info.hidden_size, info.vocab_size, aux_layers,
             f"{args.dtype} (aux {args.aux_dtype}, targets {args.targets})", compute_dtype, device)

    # 2. The prepared data.
    samples, _ = check_prepared_data(config.output.prepared_data, config.verifier.model_path,
                                     config.batches.max_seq_len, info, log)

    # 3.-6. The output folder, the plan, the run on either backend, the index and manifest.
    extract_hidden_states(config, ExtractionInputs(info, aux_layers, device, compute_dtype, samples), rank, log)


def main(argv=None) -> int:
    return run_stage(STAGE, parse, work, argv, reads=lambda args: () if args.verify else ("prepared_data",))


if __name__ == "__main__":
    sys.exit(main())
