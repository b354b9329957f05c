#!/usr/bin/env python3
"""Print the SGLang command that serves a drafter folder with its verifier (EAGLE-3), for the pinned SGLang.

  python scripts/sglang_launch_command.py RUN_DIR/checkpoints/best --model-path VERIFIER [--tp-size 8]

Defaults: 3 steps / top-1 / 4 draft tokens, triton attention for the verifier and the drafter (what works on the
SM120 GPUs of the Kimi-K2.5 deployment; docs/conventions.md says why); `--speculative-draft-model-quantization
unquant` only with --sm100 for a quantized verifier (elsewhere the drafter is unquantized without it). The
drafter's layer ids are checked against what SGLang will capture. --sampling-backend and --sglang-arg add the
engine settings a machine needs (the same spelling as stage 02's flags).
Exit 0 with the command; 1 when the command would serve the drafter wrongly (the problems are printed, and the
command is still shown); 2 for bad arguments or unreadable folders.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from eagle3_pipeline.verifier import sglang_launch as launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="drafter folder (config.json + model.safetensors)")
    parser.add_argument("--model-path", required=True, help="the verifier's folder, as SGLang will load it")
    parser.add_argument("--tp-size", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=launch.DEFAULT_NUM_STEPS)
    parser.add_argument("--topk", type=int, default=launch.DEFAULT_TOPK)
    parser.add_argument("--num-draft-tokens", type=int, default=launch.DEFAULT_NUM_DRAFT_TOKENS)
    parser.add_argument("--attention-backend", default=launch.SM120_ATTENTION_BACKEND)
    parser.add_argument("--draft-attention-backend", default=launch.SM120_DRAFT_ATTENTION_BACKEND)
    parser.add_argument("--sampling-backend", help="SGLang's sampling backend (pytorch or flashinfer); default: "
                        "SGLang's choice")
    parser.add_argument("--sglang-arg", action="append", metavar="KEY=VALUE",
                        help="any other server argument, repeatable (VALUE read as JSON when it parses; true = a bare "
                             "switch), e.g. --sglang-arg disable_cuda_graph=true; checked against the installed "
                             "SGLang's ServerArgs when SGLang is installed here")
    parser.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                        help="default: when the verifier's config.json has an auto_map")
    parser.add_argument("--port", type=int)
    parser.add_argument("--sm100", action="store_true",
                        help="the server's GPUs are SM100 (B200/GB200): a quantized verifier then needs "
                             "--speculative-draft-model-quantization unquant (docs/conventions.md)")
    parser.add_argument("--json", action="store_true", help="print {argv, command, notes, problems} as JSON")
    args = parser.parse_args(argv)

    from eagle3_pipeline.errors import UsageError
    from eagle3_pipeline.verifier.sglang_settings import parse_sglang_args

    try:
        settings = parse_sglang_args(args.sglang_arg)
        if args.sampling_backend:
            settings["sampling_backend"] = args.sampling_backend
        command = launch.build_launch_command(
            args.drafter, args.model_path, tp_size=args.tp_size, num_steps=args.num_steps, topk=args.topk,
            num_draft_tokens=args.num_draft_tokens, attention_backend=args.attention_backend,
            draft_attention_backend=args.draft_attention_backend, trust_remote_code=args.trust_remote_code,
            port=args.port, sm100=args.sm100, settings=settings)
    except UsageError as err:
        print(str(err), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(command.as_dict(), indent=2))
    else:
        for note in command.notes:
            print(f"# {note}")
        for problem in command.problems:
            print(f"# PROBLEM: {problem}")
        print(command.shell())
    return 1 if command.problems else 0


if __name__ == "__main__":
    sys.exit(main())
