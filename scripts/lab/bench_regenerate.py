#!/usr/bin/env python3
"""Speed of stage 01's regeneration engines (eagle3_pipeline.data.responders.HFResponder, --regenerate-engine).

One run, the same prompts (the first user turns of --num-prompts conversations of a ShareGPT JSON / JSONL
file, a seeded sample spread over it), greedy:

1. the verifier at --model-path (e.g. SmolLM2-135M-Instruct, a dense HF folder) in --dtype:
   - "generate" (the first engine, the reference) on every prompt;
   - the static-cache engines, each twice on every prompt with one responder, as stage 01 keeps one: cold
     (the decoding step compiled) and warm (the rate a long stage 01 run sees, its pooled caches reused):
     "static" (transformers' generate over a StaticCache, the default on a GPU) and "loop" (our own
     decoding loop over the same caches, eagle3_pipeline.data.decode_loop); their replies are compared with
     "generate"'s (where differing ones part, and how far apart the model's logits of the two tokens are
     there: a bf16 tie, or a bug). Batches are packed by the token budget (--batch-size rows at the shortest width, fewer
     when wider), each with a cache of its own width; the warm call's batches (rows, padded width, cache
     width, seconds, decoding steps, seconds per step) are written out, to show where the time goes;
   - with --profile, torch.profiler over the last batch of each warm call, run again: the top ops by
     device time and by CPU time, and the batch's device time against its wall time;
   - "continuous" (transformers' continuous batching) on the first --continuous-prompts prompts;
   - the forward pass alone (tokens/s of one full batch), the ceiling the decoding rate is held against;
   - in float32, "generate" and the static-cache engines on the first --fp32-check-prompts prompts:
     token-for-token equality;
2. a random Llama-3.1-8B-shaped verifier in bf16 (built from the config below, no download): the same
   engines but "continuous" on the first --llama-prompts prompts, and the memory-bandwidth bound of its
   decoding step.

--engines picks the engines (each part can be left out: --continuous-prompts 0, --fp32-check-prompts 0,
--llama-prompts 0); --static-only runs the static-cache engines' two calls alone. torch's compile hints
(why CUDA graphs were skipped or re-recorded, why a step was recompiled) go to the log.

Writes OUT/bench_regenerate.json and OUT/bench_regenerate.md after every measurement (a run stopped early
keeps what it measured) and prints the ratios. On one H200 with the defaults, before "loop" was added
(2026-12-02): part 1 took 5 minutes (generate 45 s, static 123 s cold and 10 s warm, continuous 19 s, the
float32 check); part 2's generate took 63 s, and its static engine was still compiling 3 minutes later
when the run was stopped, so budget 6 minutes or more for part 2, or leave it out (--llama-prompts 0):

  python scripts/lab/bench_regenerate.py --model-path /path/smollm2-dense --data sharegpt.jsonl --out results/
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path


# Llama-3.1-8B's shape (random weights: replies rarely stop early, the worst case for padded batches).
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=False)
# The same architecture at toy size, for a CPU run of this script (--llama-shape tiny).
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=2048,
                  tie_word_embeddings=False)
HBM_BYTES_PER_S = 4.8e12  # H200's HBM3e, nominal

# Engines run twice (cold, then warm on the same responder, whose pooled caches the warm call reuses).
STATIC_CACHE_ENGINES = ("static", "loop")
ENGINES = ("generate", *STATIC_CACHE_ENGINES, "continuous")
# Rows of the report's engine table, in order.
RUN_KEYS = ("generate", "static_cold", "static", "loop_cold", "loop", "continuous")
TOP_OPS = 15
# Differing reply pairs whose parting token is checked (spread over the set): one forward each.
PARTING_SAMPLE = 200


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="dense Hugging Face folder of the verifier")
    parser.add_argument("--chat-template", help="Jinja chat template file, for a tokenizer without one")
    parser.add_argument("--data", required=True, help="ShareGPT JSON / JSONL chat file (first user turns are used)")
    parser.add_argument("--out", required=True, type=Path, help="folder for bench_regenerate.json / .md")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=1024,
                        help="rows of a batch (static and loop: of the shortest prompts; wider batches take fewer)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--engines", type=engine_list, default=ENGINES,
                        help=f"comma-separated engines to run, of {','.join(ENGINES)} (default: all)")
    parser.add_argument("--continuous-prompts", type=int, default=128,
                        help="prompts for the continuous-batching engine (0: skip it); about 10 conversations/s "
                             "on an H200 with transformers 5.17 and no flash-attn")
    parser.add_argument("--fp32-check-prompts", type=int, default=64, help="0: skip the float32 equality check")
    parser.add_argument("--llama-prompts", type=int, default=256, help="0: skip the 8B-shaped verifier")
    parser.add_argument("--llama-batch-size", type=int, default=256)
    parser.add_argument("--llama-shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--static-only", action="store_true",
                        help="only the static-cache engines (static, loop; those of --engines), cold and warm, on "
                             "the verifier at --model-path: no other engine, forward rate, float32 check or "
                             "8B-shaped verifier")
    parser.add_argument("--llama-only", action="store_true",
                        help="only the 8B-shaped verifier (part 2): --model-path then gives just the tokenizer")
    parser.add_argument("--profile", action="store_true",
                        help="profile one warm batch of each static-cache engine (torch.profiler): top ops by "
                             "device and CPU time, device time against wall time")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    return parser.parse_args(argv)


def engine_list(text: str) -> tuple[str, ...]:
    engines = tuple(e.strip() for e in text.split(",") if e.strip())
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise argparse.ArgumentTypeError(f"unknown engine(s) {unknown}; of {', '.join(ENGINES)}")
    return engines


def first_turns(data: str, count: int) -> list[list[dict]]:
    """The first user turns of `count` conversations of the file: a seeded sample spread over the whole file
    (eagle3_pipeline.bench.prompts.load_prompts, as stage 05's --num-prompts), not its first lines."""
    from eagle3_pipeline.bench.prompts import load_prompts

    return [[{"role": "user", "content": prompt.turns[0]}] for prompt in load_prompts(data, count)]


def prompt_lengths(tokenizer, conversations: list) -> list[int]:
    """Tokens of each conversation rendered with the chat template, as HFResponder renders it."""
    return [len(tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]) for c in conversations]


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def log_compile_hints() -> None:
    """torch's compile diagnostics in the log: why CUDA graphs were skipped ("skipping cudagraphs due to
    ...") or recorded again, performance hints, graph breaks, and why a function was recompiled."""
    import torch._logging

    torch._logging.set_logs(perf_hints=True, cudagraphs=True, graph_breaks=True, recompiles=True)


def make_responder(model, tokenizer, stop_ids, args, engine: str, batch_size: int, device: str):
    from eagle3_pipeline.data.responders import HFResponder

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
            "batches": batch_rows(responder.batch_log[logged:]), "replies": replies}


def batch_rows(batch_log: list[dict]) -> list[dict]:
    """HFResponder.batch_log's entries with seconds per decoding step (the batch's forward passes, prefill
    included)."""
    return [{"rows": b["rows"], "width": b["width"], "cache_width": b["cache_width"],
             "seconds": round(b["seconds"], 3), "steps": b["steps"],
             "s_per_step": round(b["seconds"] / max(1, b["steps"]), 5)}
            for b in batch_log]


def forward_rate(model, device: str, batch: int, length: int) -> float:
    """Tokens/s of the forward pass alone (random tokens, one full batch, after two warm-ups)."""
    import torch

    from eagle3_pipeline.model.kernels import sdpa_without_cudnn

    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(min(10, vocab - 1), min(1000, vocab), (batch, length), device=device)
    with torch.inference_mode(), sdpa_without_cudnn():
        for _ in range(2):
            model(ids, use_cache=False, logits_to_keep=1)
        synchronize(device)
        started = time.perf_counter()
        for _ in range(5):
            model(ids, use_cache=False, logits_to_keep=1)
        synchronize(device)
    return round(5 * batch * length / (time.perf_counter() - started), 1)


def same_replies(a: list, b: list) -> dict:
    """How many replies are identical and, for the others, where they part: the share of the longer reply
    (in characters) the two have in common before the first difference. A wrong cache or mask parts them
    at once, in most replies; a near tie that bf16 rounding flips parts them somewhere along the way."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    shares = sorted(len(os.path.commonprefix([x, y])) / max(len(x), len(y)) for x, y in pairs if x != y)
    found = {"compared": len(pairs), "equal": len(pairs) - len(shares)}
    if shares:
        found.update(differing_shared_prefix_median=round(statistics.median(shares), 3),
                     differing_within_first_5_percent=sum(share < 0.05 for share in shares))
    return found


def parting_margins(model, tokenizer, prompts: list, a: list, b: list, device: str, limit: int = PARTING_SAMPLE) -> dict:
    """Where two engines' greedy replies part, how close the choice was: for up to `limit` differing pairs
    (spread over the set), each reply re-tokenized after its prompt text, one forward of `model` over the
    prompt and the replies' common tokens, and the gap between its logits of the two tokens that follow. Two
    bf16 numerics flip a choice where that gap is within bf16's spacing at the logits' size (2**-7 of the
    top logit's power of two); a wrong cache or mask parts replies at wide gaps. `prompts`: each
    conversation's prompt text (HFResponder.render), None where it has none."""
    import torch

    from eagle3_pipeline.model.kernels import sdpa_without_cudnn

    def reply_tokens(prompt_ids: list, prompt: str, reply: str) -> list | None:
        ids = list(tokenizer(prompt + reply, add_special_tokens=False)["input_ids"])
        return ids[len(prompt_ids):] if ids[:len(prompt_ids)] == prompt_ids else None

    pairs = [(p, x, y) for p, x, y in zip(prompts, a, b) if p and x is not None and y is not None and x != y]
    margins, within, skipped = [], 0, 0
    for prompt, x, y in pairs[::max(1, len(pairs) // limit)][:limit]:
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        tx, ty = reply_tokens(prompt_ids, prompt, x), reply_tokens(prompt_ids, prompt, y)
        i = len(os.path.commonprefix([tx, ty])) if tx and ty else 0
        if not tx or not ty or i >= min(len(tx), len(ty)):  # one stops where the other goes on, or the text
            skipped += 1                                      # does not re-tokenize after its prompt
            continue
        ids = torch.tensor([prompt_ids + tx[:i]], device=device)
        with torch.inference_mode(), sdpa_without_cudnn():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        margin = abs(logits[tx[i]] - logits[ty[i]]).item()
        margins.append(margin)
        within += margin <= 2.0 ** (math.floor(math.log2(max(logits.abs().max().item(), 1e-30))) - 7)
    if not margins:
        return {"parting_checked": 0, "parting_skipped": skipped} if skipped else {}
    return {"parting_checked": len(margins), "parting_skipped": skipped,
            "parting_margin_median": round(statistics.median(margins), 4), "parting_margin_max": round(max(margins), 4),
            "parting_within_bf16_spacing": within}


def agreement_text(engine: str, counts: dict) -> str:
    """One engine's reply comparison in words."""
    text = f"{engine} {counts['equal']} of {counts['compared']}"
    if "differing_shared_prefix_median" in counts:
        text += (f" (the others share a median {100 * counts['differing_shared_prefix_median']:.0f} % of their "
                 f"text before they part; {counts['differing_within_first_5_percent']} part within the first 5 %)")
    if counts.get("parting_checked"):
        text += (f"; where {counts['parting_checked']} of them part, the two tokens' logits are a median "
                 f"{counts['parting_margin_median']} apart (max {counts['parting_margin_max']}), "
                 f"{counts['parting_within_bf16_spacing']} within bf16's spacing at that size")
    return text


def for_report(key: str, run: dict) -> dict:
    """A run without its replies; the batches are kept for the static-cache engines' warm calls only."""
    return {k: v for k, v in run.items() if k != "replies" and (k != "batches" or key in STATIC_CACHE_ENGINES)}


# --- profiling one warm batch ----------------------------------------------------------------------

def last_batch(responder, conversations: list) -> list:
    """The conversations of the responder's last batch (its longest prompts). Its cache is still pooled and
    its shape compiled, so running it again is warm."""
    _, batches = responder.plan(conversations)
    return [conversations[i] for i in batches[-1]]


def profile_last_batch(responder, conversations: list, device: str) -> dict:
    """torch.profiler over the warm call's last batch run again: its shape, wall and device seconds (in
    total and per decoding step), and the top ops by device time and by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    from eagle3_pipeline.train.profiling import device_busy_seconds

    batch = last_batch(responder, conversations)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    logged = len(responder.batch_log)
    synchronize(device)
    started = time.perf_counter()
    with profile(activities=activities) as profiler:
        responder(batch)
        synchronize(device)
    wall = time.perf_counter() - started
    entry = responder.batch_log[logged]
    device_s = device_busy_seconds(profiler.events())
    steps = max(1, entry["steps"])
    averages = profiler.key_averages()
    return {"rows": entry["rows"], "width": entry["width"], "cache_width": entry["cache_width"],
            "steps": entry["steps"], "wall_s": round(wall, 3), "device_s": round(device_s, 3),
            "wall_ms_per_step": round(1000 * wall / steps, 3), "device_ms_per_step": round(1000 * device_s / steps, 3),
            "top_by_device": top_ops(averages, "self_device_time_total"),
            "top_by_cpu": top_ops(averages, "self_cpu_time_total")}


def top_ops(averages, attribute: str) -> list[dict]:
    """The TOP_OPS profiler rows (grouped by name) with the most `attribute` time, in milliseconds."""
    ranked = sorted(averages, key=lambda e: getattr(e, attribute), reverse=True)[:TOP_OPS]
    return [{"op": e.key[:100], "calls": e.count, "self_device_ms": round(e.self_device_time_total / 1000, 3),
             "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3)}
            for e in ranked if getattr(e, attribute) > 0]


# --- the parts ---------------------------------------------------------------------------------------

def bench_verifier(model, tokenizer, stop_ids, conversations, args, device, batch_size, continuous: int,
                   result: dict, save) -> dict:
    """The engines on one loaded model, the forward rate and the ratios, into `result` (saved after each).
    A static-cache engine's two calls go to one responder, as in stage 01: the warm call reuses its caches."""
    def run(key: str, engine: str, prompts: list, responder=None) -> dict:
        done = timed_run(model, tokenizer, stop_ids, prompts, args, engine, batch_size, device, responder)
        result[key] = for_report(key, done)
        print(json.dumps({key: result[key]}), flush=True)
        save()
        return done

    engines = [e for e in args.engines if e in STATIC_CACHE_ENGINES or not args.static_only]
    old = None
    if "generate" in engines:
        timed_run(model, tokenizer, stop_ids, conversations[:1], args, "generate", batch_size, device)  # warm-up
        old = run("generate", "generate", conversations)
    for engine in (e for e in STATIC_CACHE_ENGINES if e in engines):
        responder = make_responder(model, tokenizer, stop_ids, args, engine, batch_size, device)
        run(f"{engine}_cold", engine, conversations, responder)
        warm = run(engine, engine, conversations, responder)
        if old:
            counts = same_replies(old["replies"], warm["replies"])
            counts.update(parting_margins(model, tokenizer, [responder.render(c) for c in conversations],
                                          old["replies"], warm["replies"], device))
            result[f"{engine}_vs_generate_replies"] = counts
        if args.profile and responder.batch_log:
            result[f"{engine}_profile"] = profile_last_batch(responder, conversations, device)
            save()
    if "continuous" in engines and continuous:
        try:
            cb = run("continuous", "continuous", conversations[:continuous])
            if old:
                result["continuous_vs_generate_replies"] = same_replies(old["replies"][:continuous],
                                                                        cb["replies"])
        except RuntimeError as err:  # reported, not fatal: the other engines' figures still stand
            result["continuous"] = None
            result["continuous_error"] = str(err)
    if args.static_only:
        return result
    result["forward_tokens_per_s"] = forward_rate(model, device, min(batch_size, 64), 512)
    result["ratios"] = ratios(result)
    save()
    return result


def ratios(part: dict) -> dict:
    """Each engine's conversations/s over generate's and loop's over static's (where both ran), and each
    engine's generated tokens/s over the forward pass alone."""
    found = {}
    base = part.get("generate")
    for key in RUN_KEYS[1:]:
        if part.get(key) and base:
            found[f"{key}_vs_generate_conversations_per_s"] = round(
                part[key]["conversations_per_s"] / base["conversations_per_s"], 2)
    if part.get("loop") and part.get("static"):
        found["loop_vs_static_conversations_per_s"] = round(
            part["loop"]["conversations_per_s"] / part["static"]["conversations_per_s"], 2)
    for key in ("generate", *STATIC_CACHE_ENGINES):
        if part.get(key):
            found[f"{key}_generated_tokens_per_s_vs_forward"] = round(
                part[key]["generated_tokens_per_s"] / part["forward_tokens_per_s"], 4)
    return found


def fp32_check(args, tokenizer, stop_ids, conversations, device, found: dict, save) -> dict:
    """Float32: each static-cache engine's replies against "generate"'s, token for token (compared as decoded
    text of the same rows), into `found` {engine: counts} (saved after each)."""
    from eagle3_pipeline.verifier.loading import load_verifier_model

    model = load_verifier_model(args.model_path, device, "float32")
    subset = conversations[:args.fp32_check_prompts]
    old = timed_run(model, tokenizer, stop_ids, subset, args, "generate", args.batch_size, device)
    for engine in (e for e in STATIC_CACHE_ENGINES if e in args.engines):
        new = timed_run(model, tokenizer, stop_ids, subset, args, engine, args.batch_size, device)
        found[engine] = same_replies(old["replies"], new["replies"])
        print(json.dumps({f"fp32_{engine}_vs_generate": found[engine]}), flush=True)
        save()
    del model
    return found


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
    lengths = prompt_lengths(tokenizer, subset)
    context = sum(lengths) / len(lengths) + args.max_new_tokens / 2
    result.update(shape=args.llama_shape, parameters=params,
                  bound_ms_per_step=decode_bound_ms(config, params, args.llama_batch_size, context))
    result = bench_verifier(model, tokenizer, stop_ids, subset, args, device, args.llama_batch_size, 0, result, save)
    for engine in STATIC_CACHE_ENGINES:
        if result.get(engine):
            steps = sum(b["steps"] for b in result[engine]["batches"])
            result[f"{engine}_ms_per_step"] = round(1000 * result[engine]["elapsed_s"] / steps, 2)
    del model
    return result


# --- the report --------------------------------------------------------------------------------------

PARTS = ("verifier", "llama_8b_shaped")


def markdown(report: dict) -> str:
    lines = [f"# Stage 01 regeneration engines ({report['device']}, transformers {report['transformers']}, "
             f"torch {report['torch']})", "",
             f"{report['prompts']} ShareGPT first turns, {report['max_new_tokens']} new tokens, greedy, "
             f"{report['dtype']}. `_cold`: the first call (compiling on a GPU); the other static-cache rows: the "
             "second call on the same responder.", "",
             "| verifier | engine | prompts | batch | s | conversations/s | generated tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in PARTS:
        part = report.get(name) or {}
        for key in RUN_KEYS:
            run = part.get(key)
            if run:
                lines.append(f"| {name} | {key} | {run['prompts']} | {run['batch_size']} | {run['elapsed_s']} | "
                             f"{run['conversations_per_s']} | {run['generated_tokens_per_s']} |")
    lines.append("")
    for name in PARTS:
        lines += summary_lines(name, report.get(name) or {})
    if report.get("fp32_vs_generate"):
        lines.append("- float32 replies equal to generate's: " + ", ".join(
            agreement_text(engine, c) for engine, c in report["fp32_vs_generate"].items()))
    part = report.get("llama_8b_shaped") or {}
    steps = [f"{e} {part[f'{e}_ms_per_step']} ms" for e in STATIC_CACHE_ENGINES if f"{e}_ms_per_step" in part]
    if steps:
        lines.append(f"- 8B-shaped, per decoding step: {', '.join(steps)}; bound by HBM "
                     f"{part['bound_ms_per_step']} ms (weights + KV cache read once a step)")
    for name in PARTS:
        for engine in STATIC_CACHE_ENGINES:
            lines += batch_table(name, engine, report.get(name) or {})
            lines += profile_tables(name, engine, report.get(name) or {})
    return "\n".join(lines) + "\n"


def summary_lines(name: str, part: dict) -> list[str]:
    """Markdown bullets: the forward rate, the ratios, and the replies compared with generate's."""
    lines = []
    if "forward_tokens_per_s" in part:
        lines.append(f"- {name}: forward pass alone {part['forward_tokens_per_s']} tokens/s")
    if part.get("ratios"):
        lines.append(f"- {name}, ratios: {ratio_text(part['ratios'])}")
    same = [(key[:-len("_vs_generate_replies")], counts) for key, counts in part.items()
            if key.endswith("_vs_generate_replies")]
    if same:
        lines.append(f"- {name}, replies equal to generate's (same dtype): " + ", ".join(
            agreement_text(engine, c) for engine, c in same))
    return lines


def ratio_text(found: dict) -> str:
    """ratios()'s figures in words: over generate's conversations/s, loop over static, over the forward pass."""
    over_generate, over_forward = "_vs_generate_conversations_per_s", "_generated_tokens_per_s_vs_forward"
    parts = []
    named = [f"{key[:-len(over_generate)]} {v}" for key, v in found.items() if key.endswith(over_generate)]
    if named:
        parts.append("conversations/s over generate's: " + ", ".join(named))
    if "loop_vs_static_conversations_per_s" in found:
        parts.append(f"loop over static {found['loop_vs_static_conversations_per_s']}")
    named = [f"{key[:-len(over_forward)]} {v}" for key, v in found.items() if key.endswith(over_forward)]
    if named:
        parts.append("generated tokens/s over the forward pass's tokens/s: " + ", ".join(named))
    return "; ".join(parts)


def batch_table(name: str, engine: str, part: dict) -> list[str]:
    """Markdown lines: an engine's warm batches (none when it did not run)."""
    batches = (part.get(engine) or {}).get("batches")
    if not batches:
        return []
    lines = ["", f"{engine}, warm call, {name}: each batch (steps: its forward passes, prefill included)", "",
             "| rows | padded width | cache width | s | steps | s per step |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {b['rows']} | {b['width']} | {b['cache_width']} | {b['seconds']} | {b['steps']} | "
              f"{b['s_per_step']} |" for b in batches]
    return lines


def profile_tables(name: str, engine: str, part: dict) -> list[str]:
    """Markdown lines: an engine's profiled batch, its time and its top ops (none when not profiled)."""
    found = part.get(f"{engine}_profile")
    if not found:
        return []
    on_device = bool(found["top_by_device"])  # nothing ran on a device in a CPU run
    device = (f"device busy {found['device_s']} s ({found['device_ms_per_step']} ms a step)" if on_device
              else "no device time (a CPU run)")
    lines = ["", f"{engine}, profile of the warm call's last batch run again, {name}: {found['rows']} rows, "
                 f"width {found['width']}, cache {found['cache_width']}, {found['steps']} steps; wall "
                 f"{found['wall_s']} s ({found['wall_ms_per_step']} ms a step, under the profiler), {device}"]
    for title, rows in (("device", found["top_by_device"]), ("CPU", found["top_by_cpu"])):
        if rows:
            lines += ["", f"| op (top {TOP_OPS} by self {title} time) | calls | self device ms | self CPU ms |",
                      "| --- | --- | --- | --- |"]
            lines += [f"| `{r['op']}` | {r['calls']} | {r['self_device_ms']} | {r['self_cpu_ms']} |" for r in rows]
    return lines


def main(argv=None) -> int:
    import torch
    import transformers

    from eagle3_pipeline.data.chat_tokenizer import end_of_turn_ids
    from eagle3_pipeline.formats.files import write_json_atomic, write_text_atomic
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model, pick_device, resolve_model_path

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log_compile_hints()
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.model_path, chat_template=args.chat_template)
    stop_ids = end_of_turn_ids(tokenizer, resolve_model_path(args.model_path)[0])
    conversations = first_turns(args.data, args.num_prompts)
    report = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
              "transformers": transformers.__version__, "torch": torch.__version__, "model_path": args.model_path,
              "data": args.data, "prompts": len(conversations), "max_new_tokens": args.max_new_tokens,
              "dtype": args.dtype, "engines": list(args.engines)}

    def save() -> None:
        write_json_atomic(args.out / "bench_regenerate.json", report)
        write_text_atomic(args.out / "bench_regenerate.md", markdown(report))

    if not args.llama_only:
        model = load_verifier_model(args.model_path, device, args.dtype)
        report["verifier"] = {}
        bench_verifier(model, tokenizer, stop_ids, conversations, args, device, args.batch_size,
                       args.continuous_prompts, report["verifier"], save)
        del model
        if args.static_only:
            print(markdown(report), flush=True)
            return 0
        print(json.dumps({"verifier_ratios": report["verifier"]["ratios"]}), flush=True)
        if args.fp32_check_prompts:
            report["fp32_vs_generate"] = {}
            fp32_check(args, tokenizer, stop_ids, conversations, device, report["fp32_vs_generate"], save)
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
