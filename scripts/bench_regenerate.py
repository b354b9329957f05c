#!/usr/bin/env python3
"""Speed of stage 01's regeneration engines (common.data.responders.HFResponder, --regenerate-engine).

One run, the same prompts (the first user turns of a ShareGPT JSON / JSONL file), greedy:

1. the verifier at --model-path (e.g. SmolLM2-135M-Instruct, a dense HF folder) in --dtype:
   - "generate" (the first engine, today's default before this change) on every prompt;
   - "static" (the new default) twice on every prompt with one responder, as stage 01 keeps one: cold
     (transformers compiles the decoding step) and warm (the rate a long stage 01 run sees, its pooled
     caches reused); its replies are compared with "generate"'s. Batches are packed by the token budget
     (--batch-size rows at the shortest width, fewer when wider), each with a cache of its own width; the
     warm call's batches (rows, padded width, cache width, seconds, seconds per decoding step) are written
     out, to show where the time goes;
   - "continuous" (transformers' continuous batching) on the first --continuous-prompts prompts;
   - the forward pass alone (tokens/s of one full batch), the ceiling the decoding rate is held against;
   - in float32, "generate" and "static" on the first --fp32-check-prompts prompts: token-for-token equality;
2. a random Llama-3.1-8B-shaped verifier in bf16 (built from the config below, no download), "generate"
   and "static" on the first --llama-prompts prompts, and the memory-bandwidth bound of its decoding step.

Writes OUT/bench_regenerate.json and OUT/bench_regenerate.md after every measurement (a run stopped early
keeps what it measured) and prints the ratios. On one H200 with the defaults: about 4 minutes for part 1
(measured before the token budget and the cache pool: generate 44 s, static 90 s cold and 15 s warm,
continuous about 20 s, the float32 check) and 2 to 3 for part 2 (compiling the 8B-shaped model is most of
it); --llama-prompts 0 leaves part 2 out, and --static-only runs the static engine's two calls alone:

  python scripts/bench_regenerate.py --model-path /path/smollm2-dense --data sharegpt.jsonl --out results/
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import islice
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Llama-3.1-8B's shape (random weights: replies rarely stop early, the worst case for padded batches).
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=False)
# The same architecture at toy size, for a CPU run of this script (--llama-shape tiny).
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=2048,
                  tie_word_embeddings=False)
HBM_BYTES_PER_S = 4.8e12  # H200's HBM3e, nominal


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="dense Hugging Face folder of the verifier")
    parser.add_argument("--data", required=True, help="ShareGPT JSON / JSONL chat file (first user turns are used)")
    parser.add_argument("--out", required=True, type=Path, help="folder for bench_regenerate.json / .md")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=1024,
                        help="rows of a batch (static: of the shortest prompts; wider batches take fewer)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--continuous-prompts", type=int, default=128,
                        help="prompts for the continuous-batching engine (0: skip it); about 10 conversations/s "
                             "on an H200 with transformers 5.17 and no flash-attn")
    parser.add_argument("--fp32-check-prompts", type=int, default=64, help="0: skip the float32 equality check")
    parser.add_argument("--llama-prompts", type=int, default=256, help="0: skip the 8B-shaped verifier")
    parser.add_argument("--llama-batch-size", type=int, default=256)
    parser.add_argument("--llama-shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--static-only", action="store_true",
                        help="only the static engine, cold and warm, on the verifier at --model-path: no other "
                             "engine, forward rate, float32 check or 8B-shaped verifier")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    return parser.parse_args(argv)


def first_turns(data: str, count: int) -> list[list[dict]]:
    from common.data.records import BadRecords
    from common.data.sources import read_records, resolve_source

    records = read_records([resolve_source(data)], BadRecords())
    chats = [r for r in records if r.is_chat and any(m["role"] == "user" for m in r.messages)]
    return [[next(m for m in r.messages if m["role"] == "user")] for r in islice(chats, count)]


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_responder(model, tokenizer, stop_ids, args, engine: str, batch_size: int, device: str):
    from common.data.responders import HFResponder

    return HFResponder(lambda _device: model, tokenizer, stop_ids, args.max_new_tokens, 0.0, batch_size,
                       args.max_prompt_tokens, devices=[device], engine=engine)


def timed_run(model, tokenizer, stop_ids, conversations, args, engine: str, batch_size: int, device: str,
              responder=None) -> dict:
    """One responder call over every conversation (on `responder`, else a new one); its rates, replies and
    batches."""
    responder = responder or make_responder(model, tokenizer, stop_ids, args, engine, batch_size, device)
    generated, hit, logged = responder.generated_tokens, responder.hit_max_new_tokens, len(responder.batch_log)
    synchronize(device)
    started = time.perf_counter()
    replies = responder(conversations)
    synchronize(device)
    elapsed = time.perf_counter() - started
    answered = sum(r is not None for r in replies)
    generated = responder.generated_tokens - generated
    return {"engine": engine, "prompts": len(conversations), "answered": answered, "batch_size": batch_size,
            "elapsed_s": round(elapsed, 2), "conversations_per_s": round(answered / elapsed, 1),
            "generated_tokens": generated, "generated_tokens_per_s": round(generated / elapsed, 1),
            "hit_max_new_tokens": responder.hit_max_new_tokens - hit,
            "batches": batch_rows(responder.batch_log[logged:], args.max_new_tokens), "replies": replies}


def batch_rows(batch_log: list[dict], max_new_tokens: int) -> list[dict]:
    """HFResponder.batch_log's entries with seconds per decoding step: seconds / max_new_tokens, prefill
    included (a batch whose rows all stop early runs fewer steps)."""
    return [{"rows": b["rows"], "width": b["width"], "cache_width": b["cache_width"],
             "seconds": round(b["seconds"], 3), "s_per_step": round(b["seconds"] / max_new_tokens, 5)}
            for b in batch_log]


def forward_rate(model, device: str, batch: int, length: int) -> float:
    """Tokens/s of the forward pass alone (random tokens, one full batch, after two warm-ups)."""
    import torch

    from common.verifier.loading import inference_attention

    ids = torch.randint(10, 1000, (batch, length), device=device)
    with torch.inference_mode(), inference_attention():
        for _ in range(2):
            model(ids, use_cache=False, logits_to_keep=1)
        synchronize(device)
        started = time.perf_counter()
        for _ in range(5):
            model(ids, use_cache=False, logits_to_keep=1)
        synchronize(device)
    return round(5 * batch * length / (time.perf_counter() - started), 1)


def same_replies(a: list, b: list) -> dict:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return {"compared": len(pairs), "equal": sum(x == y for x, y in pairs)}


def for_report(key: str, run: dict) -> dict:
    """A run without its replies; the batches are kept for the static engine's warm call only."""
    return {k: v for k, v in run.items() if k != "replies" and (k != "batches" or key == "static")}


def bench_verifier(model, tokenizer, stop_ids, conversations, args, device, batch_size, continuous: int,
                   result: dict, save) -> dict:
    """The engines on one loaded model, the forward rate and the ratios, into `result` (saved after each).
    The static engine's two calls go to one responder, as in stage 01: the warm call reuses its caches."""
    def run(key: str, engine: str, prompts: list, responder=None) -> dict:
        done = timed_run(model, tokenizer, stop_ids, prompts, args, engine, batch_size, device, responder)
        result[key] = for_report(key, done)
        print(json.dumps({key: result[key]}), flush=True)
        save()
        return done

    static = make_responder(model, tokenizer, stop_ids, args, "static", batch_size, device)
    if args.static_only:
        run("static_cold", "static", conversations, static)
        run("static", "static", conversations, static)
        return result
    timed_run(model, tokenizer, stop_ids, conversations[:1], args, "generate", batch_size, device)  # warm-up
    old = run("generate", "generate", conversations)
    cold = run("static_cold", "static", conversations, static)
    warm = run("static", "static", conversations, static)
    result["static_vs_generate_replies"] = same_replies(old["replies"], warm["replies"])
    if continuous:
        try:
            cb = run("continuous", "continuous", conversations[:continuous])
            result["continuous_vs_generate_replies"] = same_replies(old["replies"][:continuous], cb["replies"])
        except RuntimeError as err:  # reported, not fatal: the other engines' figures still stand
            result["continuous"] = None
            result["continuous_error"] = str(err)
    result["forward_tokens_per_s"] = forward_rate(model, device, min(batch_size, 64), 512)
    base = result["generate"]
    result["ratios"] = {
        "static_vs_generate_conversations_per_s": round(warm["conversations_per_s"] / base["conversations_per_s"], 2),
        "static_cold_vs_generate_conversations_per_s":
            round(cold["conversations_per_s"] / base["conversations_per_s"], 2),
        "static_generated_tokens_per_s_vs_forward": round(warm["generated_tokens_per_s"]
                                                          / result["forward_tokens_per_s"], 4),
        "generate_generated_tokens_per_s_vs_forward": round(base["generated_tokens_per_s"]
                                                            / result["forward_tokens_per_s"], 4),
    }
    if result.get("continuous"):
        result["ratios"]["continuous_vs_generate_conversations_per_s"] = round(
            result["continuous"]["conversations_per_s"] / base["conversations_per_s"], 2)
    return result


def fp32_check(args, tokenizer, stop_ids, conversations, device) -> dict:
    """Float32: "static" and "generate" replies, token for token (compared as decoded text of the same rows)."""
    from common.verifier.loading import load_verifier_model

    model = load_verifier_model(args.model_path, device, "float32")
    subset = conversations[:args.fp32_check_prompts]
    old = timed_run(model, tokenizer, stop_ids, subset, args, "generate", args.batch_size, device)
    new = timed_run(model, tokenizer, stop_ids, subset, args, "static", args.batch_size, device)
    del model
    return same_replies(old["replies"], new["replies"])


def decode_bound_ms(config, params: int, batch: int, context: float, dtype_bytes: int = 2) -> float:
    """Milliseconds a decoding step needs at least: reading the weights and the batch's KV cache once."""
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    return round(1000 * (params * dtype_bytes + batch * context * kv_per_token) / HBM_BYTES_PER_S, 2)


def bench_llama(args, tokenizer, stop_ids, conversations, device, result: dict, save) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LLAMA_8B if args.llama_shape == "8b" else LLAMA_TINY
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    params = sum(p.numel() for p in model.parameters())
    subset = conversations[:args.llama_prompts]
    result = bench_verifier(model, tokenizer, stop_ids, subset, args, device, args.llama_batch_size, 0, result, save)
    lengths = [len(tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]) for c in subset]
    context = sum(lengths) / len(lengths) + args.max_new_tokens / 2
    steps = len(result["static"]["batches"]) * args.max_new_tokens
    result.update(shape=args.llama_shape, parameters=params,
                  static_ms_per_step=round(1000 * result["static"]["elapsed_s"] / steps, 2),
                  bound_ms_per_step=decode_bound_ms(config, params, args.llama_batch_size, context))
    del model
    return result


def markdown(report: dict) -> str:
    lines = [f"# Stage 01 regeneration engines ({report['device']}, transformers {report['transformers']}, "
             f"torch {report['torch']})", "",
             f"{report['prompts']} ShareGPT first turns, {report['max_new_tokens']} new tokens, greedy.", "",
             "| verifier | engine | prompts | batch | s | conversations/s | generated tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("verifier", "llama_8b_shaped"):
        part = report.get(name)
        if not part:
            continue
        for key in ("generate", "static_cold", "static", "continuous"):
            run = part.get(key)
            if run:
                lines.append(f"| {name} | {key} | {run['prompts']} | {run['batch_size']} | {run['elapsed_s']} | "
                             f"{run['conversations_per_s']} | {run['generated_tokens_per_s']} |")
    lines.append("")
    for name in ("verifier", "llama_8b_shaped"):
        part = report.get(name)
        if part and "ratios" in part:
            lines.append(f"- {name}: forward only {part['forward_tokens_per_s']} tokens/s; ratios "
                         f"{json.dumps(part['ratios'])}; static vs generate replies (same dtype) "
                         f"{json.dumps(part['static_vs_generate_replies'])}")
    if report.get("fp32_static_vs_generate"):
        lines.append(f"- float32, static vs generate: {json.dumps(report['fp32_static_vs_generate'])}")
    if report.get("llama_8b_shaped", {}).get("bound_ms_per_step") is not None:
        part = report["llama_8b_shaped"]
        lines.append(f"- 8B-shaped: {part['static_ms_per_step']} ms per decoding step, bound by HBM "
                     f"{part['bound_ms_per_step']} ms (weights + KV cache read once a step)")
    for name in ("verifier", "llama_8b_shaped"):
        lines += batch_table(name, report.get(name) or {})
    return "\n".join(lines) + "\n"


def batch_table(name: str, part: dict) -> list[str]:
    """Markdown lines: the static engine's warm batches (none when it did not run)."""
    batches = (part.get("static") or {}).get("batches")
    if not batches:
        return []
    lines = ["", f"Static engine, warm call, {name}: each batch (seconds per step = seconds / new tokens, "
                 "prefill included)", "",
             "| rows | padded width | cache width | s | s per step |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {b['rows']} | {b['width']} | {b['cache_width']} | {b['seconds']} | {b['s_per_step']} |"
              for b in batches]
    return lines


def main(argv=None) -> int:
    import torch
    import transformers

    from common.data.chat_tokenizer import end_of_turn_ids
    from common.formats.files import write_json_atomic, write_text_atomic
    from common.verifier.loading import load_tokenizer, load_verifier_model, pick_device, resolve_model_path

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.model_path)
    stop_ids = end_of_turn_ids(tokenizer, resolve_model_path(args.model_path)[0])
    conversations = first_turns(args.data, args.num_prompts)
    report = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
              "transformers": transformers.__version__, "torch": torch.__version__, "model_path": args.model_path,
              "data": args.data, "prompts": len(conversations), "max_new_tokens": args.max_new_tokens,
              "dtype": args.dtype}

    def save() -> None:
        write_json_atomic(args.out / "bench_regenerate.json", report)
        write_text_atomic(args.out / "bench_regenerate.md", markdown(report))

    model = load_verifier_model(args.model_path, device, args.dtype)
    report["verifier"] = {}
    bench_verifier(model, tokenizer, stop_ids, conversations, args, device, args.batch_size,
                   args.continuous_prompts, report["verifier"], save)
    del model
    save()
    if args.static_only:
        print(markdown(report), flush=True)
        return 0
    print(json.dumps({"verifier_ratios": report["verifier"]["ratios"]}), flush=True)
    if args.fp32_check_prompts:
        report["fp32_static_vs_generate"] = fp32_check(args, tokenizer, stop_ids, conversations, device)
        print(json.dumps({"fp32_static_vs_generate": report["fp32_static_vs_generate"]}), flush=True)
        save()
    if args.llama_prompts:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        report["llama_8b_shaped"] = {}
        bench_llama(args, tokenizer, stop_ids, conversations, device, report["llama_8b_shaped"], save)
        save()
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
