#!/usr/bin/env python3
"""Time what stage 04 --online adds to a training step: the verifier's states of one micro-batch.

For micro-batches planned as stage 04 plans them (random token ids, lengths between --min-len and --max-len,
at most --max-tokens-per-batch padded tokens, lengths rounded up to --pad-to), side by side in one run:
  forward   the verifier's base model alone (common.verifier.capture.run_base), nothing kept;
  states    common.train.online.OnlineStates, what the online run calls: the forward with the aux-layer
            capture, the rows gathered and laid out as a collated batch on the device;
each after --warmup batches, with a device sync after every batch, as ms per batch and tokens/s. With
--profile the states part also runs under torch.profiler and its top operations by host time are printed.

    python scripts/bench_online_states.py --model-path /models/SmolLM2-135M-Instruct --device cuda
    python scripts/bench_online_states.py --model-path tests/assets/stories260K --device cpu --batches 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from common.formats.layer_ids import default_aux_layers  # noqa: E402
from common.formats.storage import StorageFormat  # noqa: E402
from common.model.kernels import sdpa_without_cudnn  # noqa: E402
from common.train.data import collate, plan_batches  # noqa: E402
from common.train.online import OnlineStates  # noqa: E402
from common.verifier.capture import find_text_model, run_base  # noqa: E402
from common.verifier.loading import load_verifier_model, read_verifier_info  # noqa: E402


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


def timed(name: str, batches: list[dict], run, args) -> dict:
    for batch in batches[: args.warmup]:
        run(batch)
    synchronize(args.device)
    seconds, tokens = [], 0
    for batch in batches[args.warmup:]:
        started = time.perf_counter()
        run(batch)
        synchronize(args.device)
        seconds.append(time.perf_counter() - started)
        tokens += int(batch["attention_mask"].sum())
    total = sum(seconds)
    return {"part": name, "batches": len(seconds), "ms_per_batch": round(1000 * total / len(seconds), 2),
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

    results = [timed("forward", batches, forward, args),
               timed("states", batches, lambda batch: states(batch, args.device), args)]
    for result in results:
        print(json.dumps(result), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            for batch in batches[args.warmup: args.warmup + 5]:
                states(batch, args.device)
            synchronize(args.device)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
