"""The "loop" regeneration engine: a minimal decoding loop over a StaticCache and the model's forward.

`generate` spends most of a small verifier's decoding step outside the model: per-step input preparation
and mask building in eager mode, logits processors, stopping criteria, and a host sync every step to ask
whether all rows are done. This loop does only what stage 01's replies need:

1. prefill: one eager forward over the left-padded prompts, filling the cache;
2. decoding: one token per row per step, the forward compiled once per model with CUDA graphs on a GPU
   (eager on a CPU); positions advance on the device, the attention mask is one fixed buffer for the batch;
3. stopping: rows that hit a stop id keep producing pad, and the host asks whether every row is done only
   every CHECK_EVERY steps.

Greedy picks the first index of the largest float32 logit, as `generate` does; sampling draws from
softmax(logits / temperature) with torch's global RNG (no top-k; top-p only for --synthesize's user turns), as
stage 01's --temperature does.
The StaticCache keeps its own fill counter on the device (transformers 5.x), so no cache positions are
passed: a reset cache starts at 0 and each forward advances it by its query length.
"""
from __future__ import annotations

import os

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.data.static_cache import forward_cache_keyword
from eagle3_pipeline.top_p import top_p_probabilities

# Steps between the host's checks that every row has stopped: each check waits for the device, so a
# batch that is done runs at most this many steps too many (producing pads).
CHECK_EVERY = 16
# With static shapes, dynamo compiles the decoding step once per (rows, cache width) and per pooled cache: more
# than its default limit (8) in a run of several prompt widths, after which it would run the step eagerly.
RECOMPILE_LIMIT = 64
# How the decoding step runs on a GPU, by EAGLE3_DECODE_COMPILE (docs/conventions.md; measured on an H100 in
# docs/results/2026-12-07-h100-data-engine.md):
#   dynamic  the default: torch.compile once for every shape (no CUDA graphs of its own), captured per cache by
#            cuda_graphs.py. Per step as fast as static, or 1-2 % faster.
#   static   torch.compile with CUDA graphs ("reduce-overhead") and static shapes, as transformers compiles
#            generate's step: each batch shape compiled apart, about 22 s each. Prompt widths step by 128, so a run
#            compiles up to 16 shapes per reply length.
#   eager    the model's forward uncompiled, captured per cache by cuda_graphs.py: no compiling, 0.79x per step
COMPILE_WAYS = ("dynamic", "static", "eager")
COMPILE_OPTIONS = {"mode": "reduce-overhead", "dynamic": False}
DYNAMIC_OPTIONS = {"dynamic": True}
COMPILE_ENV = "EAGLE3_DECODE_COMPILE"


def decode(model, cache, input_ids, prompt_mask, cache_width: int, max_new_tokens: int, stop_ids, pad_id: int,
           temperature: float, top_p: float = 1.0, on_check=None, live_rows: int | None = None) -> list[list[int]]:
    """Generated token rows (each `max_new_tokens` long at most, pads after its stop id) for `input_ids`, a
    [rows, width] batch left-padded as `prompt_mask` (1 = token, 0 = pad) says, decoding into `cache`, an
    empty StaticCache of `cache_width` >= width + max_new_tokens positions. `on_check(steps, tokens)` is told
    the steps run and the tokens generated (up to each stop id) every CHECK_EVERY steps, when the host waits
    for the device anyway. With `live_rows`, only the first rows are wanted: the others fill the batch to a
    shape already compiled, count as stopped from the start and are not returned."""
    import torch

    rows, width = input_ids.shape
    live_rows = rows if live_rows is None else live_rows
    device = input_ids.device
    # One mask for the whole batch: pads 0, all else 1. Positions not yet written are hidden by causality
    # (a query attends only to positions up to its own), so the buffer never changes.
    mask = torch.ones(rows, cache_width, dtype=prompt_mask.dtype, device=device)
    mask[:, :width] = prompt_mask
    # Left pads get position 0 (their cumsum is 0, minus 1), as generate gives them; they are masked anyway.
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    out = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    finished[live_rows:] = True  # filler rows: they never stop the batch, nor count as generated
    generated = torch.zeros((), dtype=torch.long, device=device)  # counted on the device: read only at checks
    given = {forward_cache_keyword(type(model)): cache, "attention_mask": mask, "use_cache": True, "logits_to_keep": 1}

    logits = model(input_ids=input_ids, position_ids=positions, **given).logits
    step_forward = decoding_forward(model)
    position = positions[:, -1:]
    for step in range(max_new_tokens):
        token = next_token(logits[:, -1], temperature, top_p).masked_fill(finished, pad_id)
        out[:, step] = token
        if on_check is not None:
            generated += (~finished).sum()
        finished |= torch.isin(token, stops)
        if step + 1 == max_new_tokens or all_finished(finished, step + 1):
            break
        if on_check is not None and (step + 1) % CHECK_EVERY == 0:
            on_check(step + 1, int(generated))
        position = position + 1
        mark_step(device)
        logits = step_forward(input_ids=token[:, None], position_ids=position, **given).logits
    return out[:live_rows, :step + 1].tolist()


def all_finished(finished, steps: int) -> bool:
    """Whether every row has stopped, asked only every CHECK_EVERY steps (the answer waits for the device)."""
    return steps % CHECK_EVERY == 0 and bool(finished.all())


def next_token(logits, temperature: float, top_p: float = 1.0):
    """One token per row: greedy (the first index of the largest logit) at temperature 0, else a sample (from
    the smallest set of most likely tokens holding `top_p` of the probability, when below 1)."""
    import torch

    scores = logits.float()
    if temperature <= 0:
        return scores.argmax(dim=-1)
    probabilities = top_p_probabilities(torch.softmax(scores / temperature, dim=-1), top_p)
    return torch.multinomial(probabilities, num_samples=1).squeeze(1)


def decoding_forward(model):
    """The callable for decoding steps: on a GPU, as EAGLE3_DECODE_COMPILE says (compile_way); on a CPU, the
    model. Prefill stays eager: it runs once a batch, at a shape of its own."""
    if next(model.parameters()).device.type != "cuda":
        return model
    way = compile_way()
    if way == "static":
        return compiled_forward(model, COMPILE_OPTIONS)
    from eagle3_pipeline.data.cuda_graphs import GraphedStep

    forward = model if way == "eager" else compiled_forward(model, DYNAMIC_OPTIONS)
    return GraphedStep(forward, forward_cache_keyword(type(model)))


def compile_way() -> str:
    """EAGLE3_DECODE_COMPILE's way of running the decoding step (COMPILE_WAYS; dynamic when unset)."""
    way = os.environ.get(COMPILE_ENV) or COMPILE_WAYS[0]
    if way not in COMPILE_WAYS:
        raise UsageError(f"{COMPILE_ENV}={way!r}: give dynamic (one compiled step for every shape, CUDA graphs "
                         "captured per cache; the default), static (one compiled step per batch shape) or eager "
                         "(uncompiled, CUDA graphs captured per cache)")
    return way


def compiled_forward(model, options: dict):
    """The model's forward compiled with these torch.compile options, once per model and options (kept on it)."""
    compiled = model.__dict__.setdefault("_decode_loop_forwards", {})  # a plain attribute, not a submodule
    key = tuple(sorted(options.items()))
    if key not in compiled:
        import torch

        raise_recompile_limit(RECOMPILE_LIMIT)
        compiled[key] = torch.compile(model.forward, **options)
    return compiled[key]


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep `limit` compiled versions of one function (`recompile_limit`, formerly
    `cache_size_limit`): beyond the limit it runs the function eagerly, without graphs."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def mark_step(device) -> None:
    """On a GPU, tell CUDA graphs a new step begins: the previous step's outputs (already read) may be
    overwritten."""
    if device.type == "cuda":
        import torch

        torch.compiler.cudagraph_mark_step_begin()
