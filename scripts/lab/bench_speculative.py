#!/usr/bin/env python3
"""Speed of stage 05's speculative decoding loop (eagle3_pipeline.bench.speculative) on one GPU, batch 1.

For each prompt: the same loop without drafting (plain_decode), transformers' generate, and speculative
decoding with a drafter, all greedy (the speculative output is checked token for token against
plain_decode). Then the cost of the pieces, CUDA-synchronised and averaged: a verifier forward of 1 token
and of k+1 tokens on a KV cache, a drafter step, a drafter extend, and one whole speculative iteration
(wall time / verify steps), with the speedup they project for acceptance lengths 2..k+1.

The drafter: --draft-model-path (a trained checkpoint), or one built here from the verifier (random layer,
the verifier's lm_head over the full vocabulary), optionally wrapped as an ORACLE (--oracle): it runs the
drafter's full forward (same cost) and then forces its top token to the verifier's known greedy
continuation, so every draft is accepted and tau = k+1: the loop's best case on this machine. Use it to
see whether the loop itself can reach the target speedup before a trained drafter exists.

Usage (H200; the verifier as a dense HF folder, e.g. the SmolLM2 copy made per device_smollm2.md):
  python scripts/lab/bench_speculative.py --model-path /root/v/dense --device cuda --num-steps 3 --oracle
  python scripts/lab/bench_speculative.py --model-path /root/v/dense --device cuda --draft-model-path RUN/checkpoints/best
CPU smoke test: python scripts/lab/bench_speculative.py --model-path ../shared/models/stories260K --device cpu \\
  --dtype float32 --max-new-tokens 32 --oracle
Where a GPU loop loses its time: --cprofile (host time by function), --sync-debug (every operation that makes
the host wait for the GPU, by source line). --random-weights builds the verifier from the folder's config.json
with random weights (only its config and tokenizer are read): the loop's costs at a model's shape, for timing
only, where its weights cannot be brought (the oracle keeps every draft accepted).
stdout carries JSON lines; they are also appended to $OUT/bench_speculative.jsonl when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a rainbow forms, step by step.",
           "Give me three tips for learning a new language, with an example for each.",
           "What is the difference between a list and a tuple in Python?"]


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "bench_speculative.jsonl", "a") as handle:
            handle.write(line + "\n")


class OracleDrafter(torch.nn.Module):
    """A real drafter whose top draft is forced to the known greedy continuation `reference` (full
    sequence ids on the device): the row at position t predicts token t+2, as EAGLE-3 aligns drafts."""

    def __init__(self, drafter, boost: float = 1e4):
        super().__init__()
        self.inner = drafter
        self.config = drafter.config
        self.boost = boost
        draft_ids = drafter.draft_token_ids()
        self.to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
        self.to_draft[draft_ids] = torch.arange(len(draft_ids), device=draft_ids.device)
        self.reference = None

    def fuse(self, aux):
        return self.inner.fuse(aux)

    def draft_to_target(self, draft_ids):
        return self.inner.draft_to_target(draft_ids)

    def decode(self, input_ids, hidden, position_ids, cache=None, attention_mask=None):
        out, logits = self.inner.decode(input_ids, hidden, position_ids, cache, attention_mask=attention_mask)
        want = self.reference[(position_ids + 2).clamp(max=self.reference.numel() - 1)]
        draft = self.to_draft[want]
        bonus = (draft >= 0).to(logits.dtype).unsqueeze(-1) * self.boost
        return out, logits.scatter_add(-1, draft.clamp_min(0).unsqueeze(-1), bonus)


def build_drafter(args, verifier, info, device, dtype):
    from eagle3_pipeline.model.checkpoint import load_drafter
    from eagle3_pipeline.formats.layer_ids import default_aux_layers
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.drafter import Eagle3Drafter

    embed = verifier.get_input_embeddings().weight.detach()
    if args.draft_model_path:
        return load_drafter(args.draft_model_path, embed=embed, device=device, dtype=dtype)
    vocab = info.vocab_size
    config = DrafterConfig.from_verifier(info, vocab, default_aux_layers(info.num_layers))
    drafter = Eagle3Drafter(config)
    drafter.init_from_verifier(embed.float().cpu(), verifier.get_output_embeddings().weight.detach().float().cpu(),
                               torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    drafter = drafter.to(device)
    for param in drafter.parameters():
        param.data = param.data.to(dtype)
    return drafter.eval()


def timed(fn, device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs, synchronised."""
    from eagle3_pipeline.bench.decoding import synchronize

    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def component_costs(verifier, drafter, ids, k: int, device, repeats: int) -> dict:
    """Seconds per verifier forward (1 and k+1 tokens on a cache), drafter step and extend."""
    from eagle3_pipeline.model.drafter import DrafterCache
    from eagle3_pipeline.bench.verifier_runner import VerifierRunner
    from eagle3_pipeline.verifier.capture import LayerInputCapture, decoder_layers, whole

    runner = VerifierRunner(verifier)
    cache = runner.new_cache()
    prompt = torch.tensor([ids], device=device)
    n = prompt.shape[1]
    with LayerInputCapture(decoder_layers(verifier), drafter.config.aux_layers, select=whole) as capture:
        runner(prompt, cache, last_only=True)
        aux = capture.take_concatenated()

        def verify(tokens):
            runner(prompt[:, :tokens], cache)
            capture.take_concatenated()
            runner.crop(cache, n)

        def verify_own_mask(tokens):
            runner(prompt[:, :tokens], cache, attention_mask=runner.causal_mask(n, tokens, runner.dtype))
            capture.take_concatenated()
            runner.crop(cache, n)

        one = timed(lambda: verify(1), device, repeats)
        many = timed(lambda: verify(k + 1), device, repeats)
        many_own_mask = timed(lambda: verify_own_mask(k + 1), device, repeats)
    dcache = DrafterCache()
    hidden = drafter.fuse(aux)
    positions = torch.arange(n + 8, device=device)[None]
    out, _ = drafter.decode(prompt, hidden, positions[:, :n], dcache)

    def step():
        drafter.decode(prompt[:, -1:], out[:, -1:], positions[:, n:n + 1], dcache)
        dcache.crop(n)

    def extend():
        drafter.decode(prompt[:, -3:], hidden[:, -3:], positions[:, n:n + 3], dcache)
        dcache.crop(n)

    return {"verifier_forward_1_s": one, f"verifier_forward_{k + 1}_s": many,
            f"verifier_forward_{k + 1}_explicit_mask_s": many_own_mask,
            "drafter_step_s": timed(step, device, repeats), "drafter_extend_3_s": timed(extend, device, repeats)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--draft-model-path")
    parser.add_argument("--oracle", action="store_true", help="force every draft to the greedy continuation")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cprofile", action="store_true",
                        help="also print where the host time of one speculative and one plain generation goes")
    parser.add_argument("--sync-debug", action="store_true",
                        help="also list the operations that synchronise with the GPU in one generation of each loop")
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights at the shape of --model-path's config.json (timing only)")
    parser.add_argument("--cudnn-attention", action="store_true",
                        help="let PyTorch pick cuDNN's attention for the verifier (EAGLE3_CUDNN_ATTENTION=1), "
                             "which the loops otherwise switch off (eagle3_pipeline.model.kernels.sdpa_without_cudnn)")
    parser.add_argument("--hf-mask", action="store_true",
                        help="verify with transformers' own causal mask instead of the explicit one")
    args = parser.parse_args(argv)
    if args.cudnn_attention:
        os.environ["EAGLE3_CUDNN_ATTENTION"] = "1"

    from eagle3_pipeline.bench.prompts import has_chat_template, render_conversation
    from eagle3_pipeline.bench.decoding import hf_generate, plain_decode
    from eagle3_pipeline.bench.speculative import SpeculativeDecoder
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model, read_verifier_info

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    info = read_verifier_info(args.model_path, with_tokenizer_hash=False)
    tokenizer = load_tokenizer(args.model_path)
    verifier = (random_verifier(args.model_path, device, dtype) if args.random_weights
                else load_verifier_model(args.model_path, args.device, args.dtype))
    drafter = build_drafter(args, verifier, info, device, dtype)
    if args.oracle:
        drafter = OracleDrafter(drafter)
    decoder = SpeculativeDecoder(verifier, drafter, num_steps=args.num_steps, topk=args.topk,
                                 num_draft_tokens=args.num_draft_tokens, explicit_mask=not args.hf_mask)
    raw = not has_chat_template(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompts = [render_conversation(tokenizer, [{"role": "user", "content": p}], raw) for p in PROMPTS]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    import transformers

    base = {"model": args.model_path, "random_weights": args.random_weights, "device": str(device), "gpu": gpu,
            "dtype": args.dtype, "cudnn_attention": args.cudnn_attention, "torch": torch.__version__,
            "transformers": transformers.__version__, "drafting": decoder.drafting, "oracle": args.oracle, "drafter": args.draft_model_path or "built here"}

    def run_all(ids):
        plain, plain_stats = plain_decode(verifier, ids, args.max_new_tokens, eos)
        if args.oracle:
            drafter.reference = torch.tensor(ids + plain, device=device)
        spec, spec_stats = decoder.generate(ids, args.max_new_tokens, eos)
        _, hf_stats = hf_generate(verifier, ids, args.max_new_tokens, eos)
        return plain, plain_stats, spec, spec_stats, hf_stats

    run_all(prompts[0])  # warm-up
    totals = {"plain": [0, 0.0], "spec": [0, 0.0], "hf": [0, 0.0]}
    iteration_s, taus, identical = [], [], 0
    for index, ids in enumerate(prompts):
        plain, plain_stats, spec, spec_stats, hf_stats = run_all(ids)
        identical += spec == plain
        for name, stats in (("plain", plain_stats), ("spec", spec_stats), ("hf", hf_stats)):
            totals[name][0] += stats.new_tokens
            totals[name][1] += stats.wall_s
        iteration_s.append(spec_stats.wall_s / max(spec_stats.verify_steps, 1))
        taus.append(spec_stats.tau)
        emit({**base, "kind": "prompt", "prompt": index, "prompt_tokens": len(ids), "new_tokens": len(spec),
              "tau": spec_stats.tau, "identical_to_plain": spec == plain,
              "tokens_per_s": {"spec": spec_stats.tokens_per_s, "plain": plain_stats.tokens_per_s,
                               "hf_generate": hf_stats.tokens_per_s}})
    tps = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    costs = component_costs(verifier, decoder.drafter, prompts[0], args.num_steps, device, args.repeats)
    per_token_plain = 1.0 / tps["plain"]
    iteration = statistics.median(iteration_s)
    projected = {str(t): t * per_token_plain / iteration for t in range(2, args.num_steps + 2)}
    emit({**base, "kind": "summary", "tau": sum(taus) / len(taus), "identical_to_plain": f"{identical}/{len(prompts)}",
          "tokens_per_s": tps, "speedup_vs_plain": tps["spec"] / tps["plain"],
          "speedup_vs_hf_generate": tps["spec"] / tps["hf"], "iteration_s": iteration,
          "draft_cost_ratio_c": costs["drafter_step_s"] / costs["verifier_forward_1_s"],
          "projected_speedup_vs_plain_at_tau": projected, **costs})
    if args.oracle:  # the diagnostics below decode prompts[0]
        plain, _ = plain_decode(verifier, prompts[0], args.max_new_tokens, eos)
        drafter.reference = torch.tensor(prompts[0] + plain, device=device)
    loops = {"speculative": lambda: decoder.generate(prompts[0], args.max_new_tokens, eos),
             "plain": lambda: plain_decode(verifier, prompts[0], args.max_new_tokens, eos),
             "hf_generate": lambda: hf_generate(verifier, prompts[0], args.max_new_tokens, eos)}
    if args.cprofile:
        for name, loop in loops.items():
            host_profile(loop, name)
    if args.sync_debug and device.type == "cuda":
        for name, loop in loops.items():
            emit({**base, "kind": "syncs", "loop": name, "syncs": synchronisations(loop)})
    return 0


def random_verifier(model_path: str, device, dtype):
    """A causal LM at the shape of model_path's config.json, randomly initialised (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3_pipeline.verifier.loading import resolve_model_path

    folder, _ = resolve_model_path(model_path)
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def synchronisations(fn, top: int = 15) -> list:
    """The source lines whose operations made the host wait for the GPU during fn(), most frequent first
    (torch.cuda.set_sync_debug_mode warns at each such operation)."""
    import traceback
    import warnings
    from collections import Counter

    where = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        caller = next((f for f in reversed(frames) if "torch/" not in f.filename), frames[-1])
        where[f"{caller.filename.split('site-packages/')[-1]}:{caller.lineno} {caller.line}"] += 1

    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [{"count": count, "at": at} for at, count in where.most_common(top)]


def host_profile(fn, name: str, top: int = 30) -> None:
    """cProfile of one call, heaviest functions by own time: where the host's time goes."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    print(f"--- host time, {name} ---\n{text.getvalue()}", flush=True)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / f"cprofile_{name}.txt").write_text(text.getvalue())


if __name__ == "__main__":
    sys.exit(main())
