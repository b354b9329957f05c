#!/usr/bin/env python3
"""How long a verifier's greedy replies run at a token budget, and how much of them repeats.

Tau depends on how long the replies run (docs/benchmarking.md, "Reply length"). A small model's greedy reply
that runs to the budget usually ends in a loop, and a drafter copies a loop at will, so a tau measured over
such replies measures the loop. Before a stage-05 run at the field's 2,048 tokens a turn, this says, for the
first user turn of each chosen prompt: how many tokens the reply took, whether it ended (an end-of-turn token)
before the budget, and the share of its tokens inside a repeated 4-gram (stage 05's repetition measure) over
its first 128 tokens and over all of it.

--num-prompts picks a sample spread over the categories, as stage 05 does (default 8: one per MT-bench
category). Greedy decoding with transformers' generate (stage 05's hf_generate), batch 1. Prints one Markdown table; --output also
writes the rows, with each reply's tokens, as JSON (atomically).

  python3 scripts/lab/reply_lengths.py --model-path smollm2-dense --prompts mt_bench.jsonl --max-new-tokens 2048
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eagle3_pipeline.bench.decoding import GenerationStats, hf_generate
from eagle3_pipeline.bench.metrics import repetition_share
from eagle3_pipeline.bench.prompts import has_chat_template, load_prompts, render_conversation
from eagle3_pipeline.bench.report import markdown_table
from eagle3_pipeline.data.chat_tokenizer import end_of_turn_ids
from eagle3_pipeline.formats.files import write_json_atomic
from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

EARLY_WINDOW = 128  # the budget of the GPU runs before 2026-12-03


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="Hugging Face folder of the verifier")
    parser.add_argument("--prompts", required=True, help="prompt file in any format stage 05 reads")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts, spread over the categories")
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="the budget of each reply")
    parser.add_argument("--seed", type=int, default=0, help="shuffles each category's prompts")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--output", type=Path, help="also write the rows here as JSON")
    return parser.parse_args(argv)


def reply_row(prompt, new_tokens: list[int], stats: GenerationStats, budget: int) -> dict:
    return {"id": prompt.id, "category": prompt.category, "new_tokens": len(new_tokens),
            "ended": stats.stopped_by == "eos",
            "repetition_4gram_first_128": repetition_share(new_tokens[:EARLY_WINDOW]),
            "repetition_4gram_all": repetition_share(new_tokens), "budget": budget,
            "seconds": round(stats.wall_s, 1), "tokens": new_tokens}


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts, args.num_prompts, args.seed)
    tokenizer = load_tokenizer(args.model_path)
    model = load_verifier_model(args.model_path, args.device, args.dtype)
    stops = end_of_turn_ids(tokenizer, args.model_path)
    raw = not has_chat_template(tokenizer)
    rows = []
    for prompt in prompts:
        ids = render_conversation(tokenizer, [{"role": "user", "content": prompt.turns[0]}], raw)
        new_tokens, stats = hf_generate(model, ids, args.max_new_tokens, sorted(stops))  # greedy
        rows.append(reply_row(prompt, new_tokens, stats, args.max_new_tokens))
        progress = {k: v for k, v in rows[-1].items() if k != "tokens"}
        print(json.dumps(progress), file=sys.stderr, flush=True)  # one line a reply
    print(markdown_table(["prompt", "category", "new tokens", "ended before the budget",
                          f"4-gram repetition, first {EARLY_WINDOW}", "4-gram repetition, all"],
                         [(r["id"], r["category"], r["new_tokens"], "yes" if r["ended"] else "no",
                           r["repetition_4gram_first_128"], r["repetition_4gram_all"]) for r in rows]))
    ran_out = sum(not r["ended"] for r in rows)
    print(f"\n{ran_out} of {len(rows)} replies ran to the {args.max_new_tokens}-token budget.")
    if args.output:
        write_json_atomic(args.output, {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
