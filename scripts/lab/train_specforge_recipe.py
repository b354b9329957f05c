#!/usr/bin/env python3
"""Train a drafter with SpecForge 0.2.0's own offline EAGLE-3 recipe on a run directory of ours, and export it
where stage 05 benchmarks it.

  python scripts/lab/train_specforge_recipe.py --run-dir RUN_DIR [--model-path VERIFIER] [--output-dir DIR]

RUN_DIR needs stages 02 (hidden_states/) and 03 (vocab/); with our stage 04 run (checkpoints/) its epochs, lr,
seed, max_seq_len (SpecForge's max_length) and TTT steps are used, and its validation ids are left out, so both
drafters train on the same samples for the same epochs. Everything else is SpecForge's default (the output
lists which): its drafter (random init, the verifier's frozen embedding), one sequence per step, KL loss with
ploss 0.8**i, BF16Optimizer (fp32-master AdamW, clip 0.5, warmup 1.5 % then cosine), bf16, flex_attention on GPU
(sdpa on CPU), FSDP on one GPU as `specforge train`. SpecForge must be importable: pip install --no-deps
specforge==0.2.0 (offline: pip install --no-deps --target DIR specforge-0.2.0-py3-none-any.whl and
--specforge-path DIR); on GPU it also needs triton (torch's CUDA builds ship it).

Writes OUTPUT_DIR (default RUN_DIR/specforge): best/ (our drafter format: config.json + model.safetensors,
checked like stage 04's), specforge_results.json (settings and where each came from, steps, tokens, wall time,
tokens/s, final train accuracy per TTT step), metrics.jsonl (every step's SpecForge metrics), manifest.json.
Benchmark it with: 05_benchmark.py --run-dir RUN_DIR --draft-model-path OUTPUT_DIR/best ...
Exit codes: 0 done, 2 bad input (nothing heavy started), 1 failure. Details: docs/training.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


STAGE = "specforge_recipe"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="run directory with stages 02 and 03 done (04 optional)")
    p.add_argument("--model-path", help="the verifier (default: the one stage 02 recorded)")
    p.add_argument("--checkpoints-dir", help="our stage 04 run whose settings and split are used "
                   "(default RUN_DIR/checkpoints; absent: SpecForge's defaults, every sample trains)")
    p.add_argument("--output-dir", help="where the drafter and results go (default RUN_DIR/specforge)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="SpecForge's model.torch_dtype (its default bfloat16; float32 for exact CPU checks)")
    p.add_argument("--attention-backend", choices=["flex_attention", "sdpa"],
                   help="SpecForge's draft attention (default: flex_attention on GPU, its default; sdpa on CPU)")
    for name, kind in (("epochs", int), ("lr", float), ("seed", int), ("max-length", int), ("ttt-steps", int)):
        p.add_argument(f"--{name}", type=kind, help="override (default: our stage 04 run's, else SpecForge's)")
    p.add_argument("--num-workers", type=int, default=4, help="data loader workers (SpecForge's default 4)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps (tests, smoke runs)")
    p.add_argument("--time-limit", type=float, help="seconds of training after which it stops and exports "
                   "what it has (recorded as stopped_early: not comparable to a full run)")
    p.add_argument("--specforge-path", help="folder holding the specforge package (pip install --target DIR)")
    args = p.parse_args(argv)
    args.output_dir = args.output_dir or str(Path(args.run_dir) / "specforge")
    return args


def work(args, log) -> None:
    from eagle3_pipeline.peer.specforge_run import run_recipe

    run_recipe(args, log)


def with_specforge_on_pythonpath(argv) -> None:
    """--specforge-path: run this script again with that folder first on PYTHONPATH (the import path is the
    environment's to set, not the library's to edit); returns when it already is, or when no folder is given."""
    args = parse(argv)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if args.specforge_path and os.path.abspath(args.specforge_path) not in paths:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(args.specforge_path), *filter(None, paths)]))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)],
                  env)


def main(argv=None) -> int:
    from eagle3_pipeline.cli.stage import run_stage

    with_specforge_on_pythonpath(argv)

    return run_stage(STAGE, parse, work, argv)


if __name__ == "__main__":
    sys.exit(main())
