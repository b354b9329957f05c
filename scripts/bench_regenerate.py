#!/usr/bin/env python3
"""Speed of stage 01's regeneration with the Hugging Face verifier (common.data.responders.HFResponder).

Runs the first user turns of a ShareGPT/JSONL file through the exact responder stage 01 uses, once per
--batch-sizes entry, and prints conversations/s and generated tokens/s as JSON lines (also appended to
$OUT/bench_regenerate.jsonl when OUT is set). Use it to size --batch-size and --max-new-tokens for a GPU
run before spending the GPU's time on a whole stage 01.

  python scripts/bench_regenerate.py --model-path /root/v/smollm2-dense --data .devdata/sharegpt.json \\
      --num-prompts 512 --batch-sizes 128,512 --max-new-tokens 256
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import islice
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--data", required=True, help="ShareGPT JSON / JSONL chat file (first user turns are used)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    return parser.parse_args(argv)


def first_turns(data: str, count: int) -> list[list[dict]]:
    from common.data.records import BadRecords
    from common.data.sources import read_records, resolve_source

    records = read_records([resolve_source(data)], BadRecords())
    chats = [r for r in records if r.is_chat]
    return [[next(m for m in r.messages if m["role"] == "user")] for r in islice(chats, count)]


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "bench_regenerate.jsonl", "a") as handle:
            handle.write(line + "\n")


def main(argv=None) -> int:
    import torch

    from common.data.chat_tokenizer import end_of_turn_ids
    from common.data.responders import HFResponder
    from common.verifier.loading import load_tokenizer, load_verifier_model, pick_device, resolve_model_path

    args = parse_args(argv)
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.model_path)
    stop_ids = end_of_turn_ids(tokenizer, resolve_model_path(args.model_path)[0])
    model = load_verifier_model(args.model_path, device, args.dtype)
    conversations = first_turns(args.data, args.num_prompts)
    for batch_size in [int(x) for x in args.batch_sizes.split(",")]:
        responder = HFResponder(lambda _device: model, tokenizer, stop_ids, args.max_new_tokens, 0.0, batch_size,
                                args.max_prompt_tokens, devices=[device])
        responder([conversations[0]])  # warm-up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        replies = responder(conversations)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        generated = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies if r)
        emit({"bench": "regenerate", "device": device, "batch_size": batch_size, "prompts": len(conversations),
              "max_new_tokens": args.max_new_tokens, "elapsed_s": round(elapsed, 2),
              "conversations_per_s": round(len(conversations) / elapsed, 2),
              "generated_tokens_per_s": round(generated / elapsed, 1),
              "hit_max_new_tokens": responder.hit_max_new_tokens,
              "steps_per_s": round(args.max_new_tokens * -(-len(conversations) // batch_size) / elapsed, 2)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
