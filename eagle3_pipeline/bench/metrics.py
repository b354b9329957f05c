"""Benchmark metrics: acceptance by draft position and by output window, pooled tokens/s and speedups,
repetition, percentiles, and two drafters' tau ratio with its paired bootstrap interval over prompts."""
from __future__ import annotations

import math
from bisect import bisect_right
from typing import Any, Sequence

import numpy as np

REPETITION_NGRAM = 4
# Where a reply's output windows begin (token positions in a turn). Tau is reported per window: a run at the
# field's 2,048 new tokens then also gives the figure of a 128-token run (its first window), and shows how
# acceptance changes along a reply (docs/benchmarking.md, "Reply length").
TAU_WINDOW_STARTS = (0, 128, 256, 512, 1024)


def repeated_flags(tokens: Sequence[int], n: int = REPETITION_NGRAM) -> list[bool]:
    """Per token: does it lie inside an n-gram which already occurred earlier in the same output?"""
    tokens = list(tokens)
    seen: set[tuple[int, ...]] = set()
    repeated = [False] * len(tokens)
    for start in range(len(tokens) - n + 1):
        gram = tuple(tokens[start:start + n])
        if gram in seen:
            for i in range(start, start + n):
                repeated[i] = True
        else:
            seen.add(gram)
    return repeated


def repetition_share(tokens: Sequence[int], n: int = REPETITION_NGRAM) -> float:
    """Share of tokens that lie inside an n-gram which already occurred earlier in the same output.

    Small verifiers loop under greedy decoding, and a loop is trivially predictable: a high share says
    that a high acceptance length comes from repetition rather than from the drafter.
    """
    return sum(repeated_flags(tokens, n)) / len(tokens) if len(tokens) >= n else 0.0


def repeated_token_count(tokens: Sequence[int], n: int = REPETITION_NGRAM) -> int:
    return sum(repeated_flags(tokens, n))


def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first position where `output` differs from `reference` (None when identical); when one is a
    prefix of the other, the position where the shorter one stops."""
    for position, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return position
    return None if len(output) == len(reference) else min(len(output), len(reference))


def share_before_divergence(output: Sequence[int], reference: Sequence[int]) -> float:
    """Share of the tokens (of the longer of the two lists) before the first divergence: 1.0 when identical."""
    first = first_divergence(output, reference)
    return 1.0 if first is None else first / max(len(output), len(reference))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(latencies: Sequence[float]) -> dict[str, float | None]:
    return {"mean": sum(latencies) / len(latencies) if latencies else None,
            "p50": percentile(latencies, 50), "p90": percentile(latencies, 90), "p99": percentile(latencies, 99)}


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def acceptance_by_position(accept_lengths: Sequence[int], num_positions: int) -> dict[str, list]:
    """Per draft position j (1-based): how often it was accepted.

    `accept_lengths` are tokens per verify step (accepted drafts + 1 bonus). Position j is accepted when at
    least j drafts were. Conditional rate = P(j accepted | j-1 accepted) (EAGLE's n-alpha); share =
    P(j accepted) over all verify steps.
    """
    steps = len(accept_lengths)
    accepted = [sum(1 for length in accept_lengths if length - 1 >= j) for j in range(1, num_positions + 1)]
    reached = [steps] + accepted[:-1]
    return {
        "accepted": accepted,
        "reached": reached,
        "conditional_rate": [_ratio(a, r) for a, r in zip(accepted, reached)],
        "share": [_ratio(a, steps) for a in accepted],
    }


def tau_by_window(runs: Sequence[dict[str, Any]], starts: Sequence[int] = TAU_WINDOW_STARTS) -> list[dict]:
    """Pooled tau of the verify steps that begin in each window [start, next start) of their turn's output.

    The prefill's token is position 0, so a turn's first verify step begins at 1. Windows no step began in
    are left out; the windows' steps and tokens add up to the whole run's. Each window also gives the 4-gram
    repetition share of the output tokens at its positions (a repeat of anything earlier in the turn counts):
    where replies loop, tau measures the loop.
    """
    tokens, steps = [0] * len(starts), [0] * len(starts)
    repeated, produced = [0] * len(starts), [0] * len(starts)
    ends = list(starts[1:]) + [None]
    for run in runs:
        position = 1
        for length in run["spec"]["accept_lengths"]:
            window = bisect_right(starts, position) - 1
            tokens[window] += length
            steps[window] += 1
            position += length
        flags = repeated_flags(run["spec"]["tokens"])
        for i, (start, end) in enumerate(zip(starts, ends)):
            repeated[i] += sum(flags[start:end])
            produced[i] += len(flags[start:end])
    return [{"from": start, "to": end, "tau": tokens[i] / steps[i], "verify_steps": steps[i],
             "repetition_4gram_share": _ratio(repeated[i], produced[i])}
            for i, (start, end) in enumerate(zip(starts, ends)) if steps[i]]


def summarize_generations(runs: Sequence[dict[str, Any]], num_positions: int) -> dict[str, Any]:
    """Pooled metrics over per-turn runs. Each run: spec/plain/hf dicts with new_tokens and wall_s, spec with
    accept_lengths, and tokens (the speculative output) for the repetition measure."""
    accept_lengths = [length for run in runs for length in run["spec"]["accept_lengths"]]
    totals: dict[str, Any] = {}
    # The baselines are absent from a --tau-only run's turns: their tokens/s and the speedups are then left
    # out of the summary (not None, not zero).
    methods = ["spec"] + [m for m in ("plain", "hf") if any(run.get(m) for run in runs) or not runs]
    for method in methods:
        present = [run[method] for run in runs if run.get(method)]
        tokens = sum(r["new_tokens"] for r in present)
        seconds = sum(r["wall_s"] for r in present)
        totals[method] = {"new_tokens": tokens, "wall_s": seconds,
                          "tokens_per_s": tokens / seconds if present and seconds > 0 else None}
    all_tokens = sum(len(run["spec"]["tokens"]) for run in runs)
    repeated = sum(repeated_token_count(run["spec"]["tokens"]) for run in runs)
    verify_steps = len(accept_lengths)
    summary = {
        "turns": len(runs),
        "tau": sum(accept_lengths) / verify_steps if verify_steps else None,
        "verify_steps": verify_steps,
        # What SGLang reports per request (completion_tokens / spec_verify_ct): the prefill's token counted
        # in, the verify steps only in the denominator; comparable with --mode server.
        "accept_length_sglang_style": _ratio(totals["spec"]["new_tokens"], verify_steps),
        "acceptance": acceptance_by_position(accept_lengths, num_positions),
        "tau_by_window": tau_by_window(runs),
        "tokens_per_s": {m: totals[m]["tokens_per_s"] for m in totals},
        "new_tokens": {m: totals[m]["new_tokens"] for m in totals},
        "wall_s": {m: totals[m]["wall_s"] for m in totals},
        "repetition_4gram_share": repeated / all_tokens if all_tokens else 0.0,
    }
    for method, key in (("plain", "speedup_vs_plain"), ("hf", "speedup_vs_hf_generate")):
        if method in totals:
            summary[key] = _ratio(totals["spec"]["tokens_per_s"], totals[method]["tokens_per_s"])
    checks = [(run, run["greedy_check"]) for run in runs if run.get("greedy_check")]
    if checks:
        summary["greedy_match"] = {
            "reference": sorted({check["reference"] for _, check in checks}),
            "turns_checked": len(checks),
            "turns_identical": sum(check["first_divergence"] is None for _, check in checks),
            "turns_parted_at_a_tie": sum(bool(check.get("tie")) for _, check in checks),
            "mean_share_before_divergence": sum(c["share_before_divergence"] for _, c in checks) / len(checks),
            "diverged": [{"prompt_id": run.get("prompt_id"), "turn": run.get("turn"),
                          "first_divergence": check["first_divergence"],
                          "share_before_divergence": check["share_before_divergence"],
                          "logit_margin": check.get("logit_margin"), "tie": bool(check.get("tie"))}
                         for run, check in checks if check["first_divergence"] is not None],
        }
    return summary


def by_category(runs: Sequence[dict[str, Any]], num_positions: int) -> dict[str, dict[str, Any]]:
    categories: dict[str, list] = {}
    for run in runs:
        if run.get("category"):
            categories.setdefault(run["category"], []).append(run)
    return {name: summarize_generations(group, num_positions) for name, group in sorted(categories.items())}


def tau_parts(summary: dict[str, Any]) -> tuple[int, int]:
    """(tokens, verify steps) of a summarize_generations summary: tau pools as sum(tokens) / sum(steps)."""
    steps = summary["verify_steps"]
    return (round(summary["tau"] * steps) if steps else 0), steps


def paired_ratio_interval(ours: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]],
                          resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of pooled tau(ours) / pooled tau(theirs) over prompts.

    ours[i] and theirs[i] are prompt i's (tokens, verify steps) (tau_parts) for each drafter. Prompts are drawn
    with replacement as pairs, since a prompt's difficulty is shared by both drafters, and each resample pools
    as the report's overall tau does, so the full sample gives the report's ratio.
    """
    a, b = np.asarray(ours, dtype=float), np.asarray(theirs, dtype=float)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] != 2 or not len(a):
        raise ValueError(f"need the same prompts' (tokens, steps) for both drafters, got shapes {a.shape}, {b.shape}")
    picks = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    (tokens_a, steps_a), (tokens_b, steps_b) = a[picks].sum(axis=1).T, b[picks].sum(axis=1).T
    ratios = (tokens_a / steps_a) / (tokens_b / steps_b)
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def higher_lower_equal(ours: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """How many prompts have ours' tau above / below / equal to theirs (cross-multiplied: exact on the counts)."""
    signs = [(ta * sb > tb * sa) - (ta * sb < tb * sa) for (ta, sa), (tb, sb) in zip(ours, theirs, strict=True)]
    return signs.count(1), signs.count(-1), signs.count(0)
