"""--mode offline: speculative decoding in this process against its two baselines, prompt by prompt."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eagle3_pipeline.bench.baseline_cache import BaselineCache
from eagle3_pipeline.bench.drafter_check import check_drafter
from eagle3_pipeline.bench.metrics import (by_category, first_divergence, repetition_share, share_before_divergence,
                                           summarize_generations)
from eagle3_pipeline.bench.prompts import has_chat_template, render_conversation
from eagle3_pipeline.bench.report import noisy_timing
from eagle3_pipeline.figures import fmt
from eagle3_pipeline.bench.settings import STAGE, BenchConfig, DecodingSettings, VerifierSpec, recorded_settings
from eagle3_pipeline.errors import UsageError, require
from eagle3_pipeline.progress import Progress

ANSWER_PREVIEW_CHARS = 2000
BASELINE_CACHE = "baselines_cache.jsonl"


def gpu_name(device: str) -> str | None:
    """The GPU's name for the report (None on CPU)."""
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else None


def load_models(verifier_spec: VerifierSpec, draft_model_path: str, log):
    """The verifier and the drafter on one device, in the compute dtype: (verifier, drafter, device)."""
    import torch
    from eagle3_pipeline.model.checkpoint import load_drafter
    from eagle3_pipeline.verifier.loading import load_verifier_model, pick_device

    from eagle3_pipeline.train.parameters import compute_dtype_for

    device = pick_device(verifier_spec.device)
    # --dtype on GPU; float32 on CPU, where bf16 is slow and its rounding makes greedy ties differ; float64
    # (the lossless check) everywhere.
    dtype = "float64" if verifier_spec.dtype == "float64" else compute_dtype_for(device, verifier_spec.dtype)
    started = time.time()
    verifier = load_verifier_model(verifier_spec.model_path, device, dtype, verifier_spec.trust_remote_code)
    embed = verifier.get_input_embeddings().weight.detach()
    drafter = load_drafter(draft_model_path, embed=embed, device=device, dtype=getattr(torch, dtype))
    drafter.eval()
    log.info("loaded the verifier and the drafter on %s (%s) in %.1f s", device, dtype, time.time() - started)
    return verifier, drafter, device


def greedy_check(spec_tokens: list[int], plain_tokens: list[int] | None, state: dict, lm_head, prompt_len: int,
                 chunk: int = 512) -> dict:
    """How the speculative output of one turn at temperature 0 compares with the verifier's greedy output.

    The reference is `plain_tokens` (the decoding loop without drafting) when the run has it, else (--tau-only)
    the verifier's argmax after every prefix of the speculative output, from `state` (sample_states: one
    teacher-forced forward over prompt + output, already run for the drafter's teacher-forced score): the
    first position where the output is not that argmax is exactly where it leaves the greedy output.
    Returns reference, first_divergence (None when identical), share_before_divergence (1.0 when identical),
    logit_margin: at the divergence, the verifier's logit of the reference token minus that of the
    speculative one (same prefix, from the teacher-forced forward, that position's logits computed alone), and
    tie: the margin is not positive. A margin near 0 is a near tie (bf16 numerics); a large one points at a bug
    (wrong tree mask, stale KV entry) rather than at rounding. A tie is where the verifier's own argmax flips
    with how its logits are computed (that row alone against a block of rows, or the decoding loop's forward
    against the teacher-forced one), so either token is its greedy choice: docs/benchmarking.md.
    """
    import torch

    weight = getattr(lm_head, "weight", lm_head)
    final = state["final"][0]

    def logits(start: int, stop: int) -> "torch.Tensor":  # rows predicting the tokens after positions start..stop-1
        with torch.inference_mode():
            # float32 at least; float64 kept, or its argmax would be taken over rounded logits
            return (final[start:stop].to(weight.device, weight.dtype) @ weight.T).to(
                torch.promote_types(weight.dtype, torch.float32))

    if plain_tokens is not None:
        reference, source = list(plain_tokens), "plain_decode"
    else:
        reference, source = [], "teacher_forced_argmax"
        for start in range(0, len(spec_tokens), chunk):
            stop = min(start + chunk, len(spec_tokens))
            reference += logits(prompt_len - 1 + start, prompt_len - 1 + stop).argmax(dim=-1).tolist()
    first = first_divergence(spec_tokens, reference)
    margin = None
    if first is not None and first < min(len(spec_tokens), len(reference)):
        row = logits(prompt_len - 1 + first, prompt_len + first)[0]
        margin = float(row[reference[first]] - row[spec_tokens[first]])
    return {"reference": source, "first_divergence": first,
            "share_before_divergence": share_before_divergence(spec_tokens, reference), "logit_margin": margin,
            "tie": margin is not None and margin <= 0}


def _turn_record(prompt, turn, ids, spec, plain, hf, check: dict | None, answer: str) -> dict:
    """One turn's entry of the report: the runs' statistics (the baselines absent in --tau-only mode) and, at
    temperature 0, the greedy check."""
    spec_tokens, spec_stats = spec
    record = {
        "prompt_id": prompt.id, "turn": turn, "category": prompt.category, "prompt_tokens": len(ids),
        "spec": {**spec_stats.as_dict(), "tokens": spec_tokens},
    }
    if plain is not None:
        record.update({"plain": plain[1].as_dict(), "hf": hf[1].as_dict(),
                       "matches_plain": (spec_tokens == plain[0]) if check else None,
                       "matches_hf_generate": (spec_tokens == hf[0]) if check else None})
    record.update({"greedy_check": check, "repetition_4gram_share": repetition_share(spec_tokens),
                   "answer": answer[:ANSWER_PREVIEW_CHARS]})
    return record


@dataclass
class DecodingSession:
    """What decoding a prompt needs: the tokenizer and stop tokens (prepare_session), then the models, the
    speculative decoder and, unless --tau-only, the cache of the no-drafting baselines (load_session). One per
    process (see decode_workers)."""
    config: BenchConfig
    info: Any
    tokenizer: Any
    raw: bool
    eos: list[int]
    num_draft_tokens: int
    verifier: Any = None
    drafter: Any = None
    device: Any = None
    decoder: Any = None
    text_model: Any = None
    baseline_cache: BaselineCache | None = None


def prepare_session(config: BenchConfig, log, checked: bool = False) -> DecodingSession:
    """Check the decoding settings and the drafter against the verifier, load the tokenizer; nothing on the
    device yet. `checked`: a worker process of a run whose parent did the checks (and logged them)."""
    from eagle3_pipeline.data.chat_tokenizer import end_of_turn_ids
    from eagle3_pipeline.bench.speculative import resolve_draft_shape
    from eagle3_pipeline.verifier.loading import load_tokenizer, read_verifier_info, resolve_model_path

    verifier, decoding = config.verifier, config.decoding
    require(verifier, "model_path")
    try:
        num_draft_tokens = resolve_draft_shape(decoding.num_steps, decoding.topk, decoding.num_draft_tokens)
    except ValueError as err:
        raise UsageError(f"--num-steps/--topk/--num-draft-tokens: {err}")
    info = read_verifier_info(verifier.model_path, verifier.trust_remote_code)
    if not checked:
        check_drafter(config, info, log)
    tokenizer = load_tokenizer(verifier.model_path, verifier.trust_remote_code, verifier.chat_template)
    raw = not has_chat_template(tokenizer)
    if raw and not checked:
        log.warning("the tokenizer has no chat template (and no --chat-template was given): prompts are sent as "
                    "plain text, turns and answers joined by blank lines")
    eos = sorted(end_of_turn_ids(tokenizer, resolve_model_path(verifier.model_path)[0]))
    return DecodingSession(config, info, tokenizer, raw, eos, num_draft_tokens)


def load_session(session: DecodingSession, log, warm: bool = True) -> None:
    """Load the models and build the decoder; `warm`: run it once (kernels, allocator, caches), untimed."""
    from eagle3_pipeline.verifier.capture import find_text_model
    from eagle3_pipeline.bench.decoding import hf_generate, plain_decode
    from eagle3_pipeline.bench.speculative import SpeculativeDecoder

    config, eos = session.config, session.eos
    decoding = config.decoding
    verifier, drafter, device = load_models(config.verifier, config.inputs.draft_model_path, log)
    session.verifier, session.drafter, session.device = verifier, drafter, device
    session.text_model = find_text_model(verifier)
    session.decoder = SpeculativeDecoder(verifier, drafter, num_steps=decoding.num_steps, topk=decoding.topk,
                                         num_draft_tokens=session.num_draft_tokens,
                                         temperature=decoding.temperature, top_p=decoding.top_p, seed=decoding.seed,
                                         acceptance_rule=decoding.acceptance_rule)
    if not decoding.tau_only:
        session.baseline_cache = BaselineCache(
            Path(config.output_dir) / BASELINE_CACHE,
            {"verifier": session.info.identity(), "device": str(device), "gpu": gpu_name(device),
             "dtype": str(next(verifier.parameters()).dtype), "stop": eos})
    if warm:
        ids = render_conversation(session.tokenizer, [{"role": "user", "content": "Hello! How are you today?"}],
                                  session.raw)
        tokens = min(16, decoding.max_new_tokens)
        session.decoder.generate(ids, tokens, eos)
        if not decoding.tau_only:
            plain_decode(verifier, ids, tokens, eos, decoding.temperature, decoding.top_p, decoding.seed)
            hf_generate(verifier, ids, tokens, eos, decoding.temperature, decoding.top_p, decoding.seed)


def _baselines(session: DecodingSession, ids: list[int], seed: int):
    """The same loop without drafting, and transformers' generate: measured once per prompt and setting."""
    from eagle3_pipeline.bench.decoding import GenerationStats, hf_generate, plain_decode

    decoding, cache = session.config.decoding, session.baseline_cache
    key = cache.key(ids, max_new_tokens=decoding.max_new_tokens, temperature=decoding.temperature,
                    top_p=decoding.top_p, seed=seed)
    entry = cache.get(key)
    if entry is None:
        plain = plain_decode(session.verifier, ids, decoding.max_new_tokens, session.eos, decoding.temperature,
                             decoding.top_p, seed)
        hf = hf_generate(session.verifier, ids, decoding.max_new_tokens, session.eos, decoding.temperature,
                         decoding.top_p, seed)
        entry = {"plain": [plain[0], plain[1].as_dict()], "hf": [hf[0], hf[1].as_dict()]}
        cache.put(key, entry)
    return tuple((tokens, GenerationStats.from_dict(stats)) for tokens, stats in (entry["plain"], entry["hf"]))


def decode_prompt(session: DecodingSession, index: int, prompt, on_turn: Callable[[dict], None]) -> tuple[dict, list]:
    """Every turn of prompt number `index` (its place in the run's prompt list, which seeds its sampling):
    (its entry of the report's per-prompt list, the teacher-forced states of its turns). `on_turn` gets
    each turn's record as soon as it is decoded."""
    from eagle3_pipeline.verifier.capture import sample_states

    decoding, tokenizer, raw = session.config.decoding, session.tokenizer, session.raw
    # The baselines hold their own conversation, on the verifier's own replies: the same one as the
    # speculative run's at temperature 0, and when sampling it does not depend on the drafting settings,
    # so a later turn's baselines are measured once and not again for every k and topk.
    messages, plain_messages, turns, states = [], [], [], []
    for turn, text in enumerate(prompt.turns):
        messages.append({"role": "user", "content": text})
        plain_messages.append({"role": "user", "content": text})
        ids = render_conversation(tokenizer, messages, raw)
        seed = decoding.seed + 1000 * index + turn
        session.decoder.reseed(seed)  # a turn's sample does not depend on the turns decoded before it
        spec = session.decoder.generate(ids, decoding.max_new_tokens, session.eos)
        plain, hf = (None, None) if decoding.tau_only else _baselines(
            session, render_conversation(tokenizer, plain_messages, raw), seed)
        answer = tokenizer.decode(spec[0], skip_special_tokens=True)
        state = sample_states(session.text_model, session.decoder.aux_layers, ids + spec[0], len(ids))
        states.append(state)
        check = None
        if decoding.temperature == 0:
            check = greedy_check(spec[0], plain[0] if plain else None, state, session.text_model.lm_head, len(ids))
        record = _turn_record(prompt, turn, ids, spec, plain, hf, check, answer)
        turns.append(record)
        on_turn(record)
        messages.append({"role": "assistant", "content": answer})
        plain_messages.append({"role": "assistant", "content": answer if plain is None else
                               tokenizer.decode(plain[0], skip_special_tokens=True)})
    entry = {"id": prompt.id, "category": prompt.category,
             "summary": summarize_generations(turns, decoding.num_steps), "turns": turns}
    return entry, states


def margin_text(margin: float | None) -> str:
    """A logit margin as the log shows it: a tie's 2e-05 stays visible (four decimals made it -0.0000)."""
    return "-" if margin is None else f"{margin:.2e}"


def log_turn(log, record: dict, decoding: DecodingSettings, max_positions: int) -> None:
    """The warnings a decoded turn may call for."""
    max_new_tokens = decoding.max_new_tokens
    if record["prompt_tokens"] + max_new_tokens + decoding.num_steps + 1 > max_positions:
        log.warning("prompt %s turn %d: %d prompt tokens + %d new tokens exceed the verifier's %d positions",
                    record["prompt_id"], record["turn"], record["prompt_tokens"], max_new_tokens, max_positions)
    check = record.get("greedy_check")
    if check and check["first_divergence"] is not None:
        log.warning("prompt %s turn %d: speculative output leaves the verifier's greedy output (%s) at token %d "
                    "of %d, logit margin %s (%s)", record["prompt_id"], record["turn"], check["reference"],
                    check["first_divergence"], len(record["spec"]["tokens"]), margin_text(check["logit_margin"]),
                    "a tie: computed alone, the verifier's logits do not prefer its greedy token there"
                    if check.get("tie") else "near 0: a tie the numerics can break; large: a bug")


def run_offline(config: BenchConfig, log, begin, prompt_spec, prompts, overlap) -> dict:
    """Decode every prompt's turns with and without the drafter; the results of --mode offline."""
    from eagle3_pipeline.bench.decode_workers import decode_in_workers, worker_count
    from eagle3_pipeline.train.step import evaluate

    decoding = config.decoding
    workers = worker_count(decoding, len(prompts))
    session = prepare_session(config, log)
    begin()
    if workers == 1:
        load_session(session, log)
    greedy = decoding.temperature == 0
    log.info("stop tokens: %s; verification: %s", session.eos,
             "greedy (output must equal the verifier's greedy output)" if greedy else
             f"{decoding.acceptance_rule} sampling at temperature {decoding.temperature}, top-p {decoding.top_p}")
    if decoding.tau_only:
        log.info("--tau-only: the two timing baselines (the loop without drafting, transformers' generate) are "
                 "skipped, so no speedups are reported%s", "; the greedy check compares each output with the "
                 "verifier's argmax after each of its prefixes (one teacher-forced forward)" if greedy else "")

    total_turns = sum(len(p.turns) for p in prompts)
    accepted = steps = 0  # the progress line's tau is over every turn done so far, as the summary's
    with Progress(total_turns, "05_benchmark offline", unit="turn") as progress:
        def on_turn(record: dict) -> None:
            nonlocal accepted, steps
            log_turn(log, record, decoding, session.info.max_position_embeddings)
            accepted += sum(record["spec"]["accept_lengths"])
            steps += len(record["spec"]["accept_lengths"])
            progress.update(1, f"tau so far {accepted / max(steps, 1):.2f}")

        if workers > 1:
            log.info("decoding in %d worker processes, each with its own verifier and drafter", workers)
            per_prompt, states = decode_in_workers(config, prompts, workers, on_turn)
            # this process's copy only now: it scores the states below, and stays off the device meanwhile
            load_session(session, log, warm=False)
        else:
            per_prompt, states = [], []
            for index, prompt in enumerate(prompts):
                entry, turn_states = decode_prompt(session, index, prompt, on_turn)
                per_prompt.append(entry)
                states.append(turn_states)
    log.info("drafting: %s", session.decoder.drafting)
    runs = [turn for entry in per_prompt for turn in entry["turns"]]
    decoded = [state for turn_states in states for state in turn_states]  # each turn as stage 02 would store it
    overall = summarize_generations(runs, decoding.num_steps)
    # Stage 04's validation on the text just decoded. Far below training's validation: the prompts (or the
    # sampled text) differ from the training data. Far above the live acceptance: the decoding loop loses
    # something; a little above it at the first position is expected (verify steps often start right after
    # a rejection, at the harder positions).
    overall["teacher_forced"] = evaluate(session.drafter, decoded, session.text_model.lm_head.weight,
                                         decoding.num_steps, device=session.device)
    if greedy:
        match = overall["greedy_match"]
        log.info("greedy check (%s): %d of %d turns identical, %d more parted at a tie, mean share of tokens "
                 "before the first divergence %s", ", ".join(match["reference"]), match["turns_identical"],
                 match["turns_checked"], match["turns_parted_at_a_tie"], fmt(match["mean_share_before_divergence"]))
    cache = session.baseline_cache
    if cache is not None and cache.hits:
        log.info("baselines: %d of %d turns reused from %s (same verifier, prompt and settings)", cache.hits,
                 total_turns, cache.path)
    verifier, device = session.verifier, session.device
    return {
        "mode": "offline",
        "stage": STAGE,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": recorded_settings(config, {"prompts": prompt_spec,
                                     "num_draft_tokens": session.decoder.num_draft_tokens,
                                     "drafting": session.decoder.drafting, "device": str(device),
                                     "compute_dtype": str(next(verifier.parameters()).dtype).replace("torch.", ""),
                                     "aux_layers": session.decoder.aux_layers, "raw_text_prompts": session.raw,
                                     "stop_token_ids": session.eos, "prompt_count": len(prompts),
                                     "gpu": gpu_name(device), "decode_workers": workers,
                                     "baselines_reused": None if cache is None else cache.hits}),
        "overlap_check": overlap,
        "overall": overall,
        "categories": by_category(runs, decoding.num_steps),
        "prompts": per_prompt,
    }


def offline_summary_line(results: dict) -> str:
    """The one-line SUMMARY of --mode offline: tau, tokens/s, speedups, acceptance by position."""
    overall = results["overall"]
    tps = overall["tokens_per_s"]
    rates = ", ".join(fmt(r, 2) for r in overall["acceptance"]["conditional_rate"])
    if "speedup_vs_plain" in overall:
        timing = (f"tok/s: speculative {fmt(tps['spec'], 1)}, same loop without drafter {fmt(tps['plain'], 1)}, "
                  f"HF generate {fmt(tps['hf'], 1)} | speedup {fmt(overall['speedup_vs_plain'], 2)}x vs loop, "
                  f"{fmt(overall['speedup_vs_hf_generate'], 2)}x vs HF generate")
        noisy = noisy_timing(overall["turns"], overall["new_tokens"].get("spec"))
        timing += f" ({noisy})" if noisy else ""
    else:
        timing = "tau only: no timing baselines"
    line = (f"tau {fmt(overall['tau'])} | {timing} | acceptance by position [{rates}] | 4-gram repetition "
            f"{fmt(overall['repetition_4gram_share'], 3)}")
    if "greedy_match" in overall:
        match = overall["greedy_match"]
        line += (f" | greedy-identical turns {match['turns_identical']}/{match['turns_checked']} (parted at a tie: "
                 f"{match['turns_parted_at_a_tie']}), mean share before divergence "
                 f"{fmt(match['mean_share_before_divergence'])}")
    taught = overall.get("teacher_forced")
    if taught:
        line += (" | teacher-forced top-1 on these outputs "
                 f"[{', '.join(fmt(a, 2) for a in taught['acc_per_step'])}]")
    return line
