#!/usr/bin/env python3
"""Time what stage 04 --online adds to a training step: the verifier's states of one micro-batch.

For micro-batches planned as stage 04 plans them (random token ids, lengths between --min-len and --max-len,
at most --max-tokens-per-batch padded tokens, lengths rounded up to --pad-to), side by side in one run:
  forward   the verifier's base model alone (eagle3_pipeline.verifier.capture.run_base), nothing kept;
  states    eagle3_pipeline.train.online.OnlineStates.complete: one micro-batch's states (the forward with the aux-layer
            capture, the rows gathered and laid out as a collated batch on the device), as validation makes them;
  pass      OnlineStates.complete_all over --batches-per-pass micro-batches at once, as training makes them
            (default: the number stage 04 takes for this verifier), per micro-batch;
each after --warmup batches, with a device sync after every batch, as ms per batch and tokens/s. With
--profile the states part also runs under torch.profiler and its top operations by host time are printed.

    python scripts/lab/bench_online_states.py --model-path /models/SmolLM2-135M-Instruct --device cuda
    python scripts/lab/bench_online_states.py --model-path tests/assets/stories260K --device cpu --batches 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from eagle3_pipeline.formats.layer_ids import default_aux_layers
from eagle3_pipeline.formats.storage import StorageFormat
from eagle3_pipeline.model.kernels import sdpa_without_cudnn
from eagle3_pipeline.train.data import collate, plan_batches
from eagle3_pipeline.train.online import OnlineStates, batches_per_pass
from eagle3_pipeline.verifier.capture import find_text_model, run_base
from eagle3_pipeline.verifier.loading import load_verifier_model, read_verifier_info


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--max-tokens-per-batch", type=int, default=8192)
    parser.add_argument("--pad-to", type=int, default=64)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batches-per-pass", type=int, default=0,
                        help="default: eagle3_pipeline.train.online.batches_per_pass")
    parser.add_argument("--profile", action="store_true")
    return parser.parse_args(argv)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def micro_batches(vocab_size: int, args) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    count = (args.batches + args.warmup) * args.max_tokens_per_batch // args.min_len + 1
    lengths = torch.randint(args.min_len, args.max_len + 1, (count,), generator=generator).tolist()
    plan = plan_batches(lengths, args.max_tokens_per_batch, 1 << 30, 0, 0, pad_to=args.pad_to)
    batches = []
    for batch in plan[: args.batches + args.warmup]:
        samples = [{"input_ids": torch.randint(3, vocab_size, (lengths[i],), generator=generator),
                    "loss_mask": torch.ones(lengths[i], dtype=torch.uint8)} for i in batch]
        batches.append(collate(samples, args.pad_to))
    return batches


def timed(name: str, items: list, run, warmup: int, device: str) -> dict:
    """ms per micro-batch and tokens/s of `run` over `items` (micro-batches, or lists of them) after `warmup`."""
    for item in items[:warmup]:
        run(item)
    synchronize(device)
    seconds, tokens, count = [], 0, 0
    for item in items[warmup:]:
        started = time.perf_counter()
        run(item)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        group = item if isinstance(item, list) else [item]
        tokens += sum(int(batch["attention_mask"].sum()) for batch in group)
        count += len(group)
    total = sum(seconds)
    return {"part": name, "micro_batches": count, "ms_per_micro_batch": round(1000 * total / count, 2),
            "tokens_per_s": round(tokens / total, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    info = read_verifier_info(args.model_path, with_tokenizer_hash=False)
    model = load_verifier_model(args.model_path, args.device, args.dtype)
    text = find_text_model(model, info.num_layers)
    batches = micro_batches(info.vocab_size, args)
    states = OnlineStates(text, default_aux_layers(info.num_layers), StorageFormat(args.dtype, dtype=args.dtype), None)

    def forward(batch):
        with torch.no_grad(), sdpa_without_cudnn():
            run_base(text, batch["input_ids"].to(args.device))

    per_pass = args.batches_per_pass or batches_per_pass(sum(p.numel() for p in text.base.parameters()))
    states.pass_tokens = per_pass * args.max_tokens_per_batch
    passes = [batches[i:i + per_pass] for i in range(0, len(batches) - per_pass + 1, per_pass)]
    results = [timed("forward", batches, forward, args.warmup, args.device),
               timed("states", batches, lambda batch: states.complete(batch, args.device), args.warmup, args.device),
               timed(f"pass of {per_pass}", passes, lambda group: states.complete_all(group, args.device), 1,
                     args.device)]
    for result in results:
        print(json.dumps(result), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            for batch in batches[args.warmup: args.warmup + 5]:
                states.complete(batch, args.device)
            synchronize(args.device)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
