"""vLLM's own acceptance figures: its speculative-decoding counters on GET /metrics, read before and after a run.

vLLM (checked against 0.26.0, `v1/spec_decode/metrics.py`) counts, per engine, the verify steps that carried drafts
(`vllm:spec_decode_num_drafts`), the drafted tokens, the accepted ones and the accepted ones at each draft position
(label `position`). Its mean acceptance length is 1 + accepted / drafts: the bonus token counted, the prefill's token
not, as stage 05's offline tau. The counters are totals since the server started, so a run's figures are the
difference of two reads. docs/benchmarking.md ("vLLM's acceptance counters").
"""
from __future__ import annotations

import re
import urllib.request
from typing import Any

PREFIX = "vllm:spec_decode_"
DRAFTS, DRAFT_TOKENS, ACCEPTED = "num_drafts", "num_draft_tokens", "num_accepted_tokens"
PER_POSITION = "num_accepted_tokens_per_pos"
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text exposition; comments skipped."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())  # a comment (# HELP, # TYPE) does not match
        if not match:
            continue
        name, labels, value = match.groups()
        try:
            samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
        except ValueError:
            continue  # NaN spellings aside, a value that is not a number is not a counter we read
    return samples


def spec_decode_counters(text: str) -> dict[str, Any] | None:
    """vLLM's speculative-decoding counter totals, summed over engines; None when the exposition has none."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for name, labels, value in parse_prometheus(text):
        if not name.startswith(PREFIX) or not name.endswith("_total"):
            continue  # the _created samples are timestamps, not counts
        counter = name[len(PREFIX):-len("_total")]
        if counter == PER_POSITION and "position" in labels:
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + value
        elif counter in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            totals[counter] = totals.get(counter, 0.0) + value
    if DRAFTS not in totals:
        return None
    return {**totals, PER_POSITION: [per_position[p] for p in sorted(per_position)]}


def read_counters(url: str, timeout: float = 30.0) -> dict[str, Any] | None:
    """GET URL/metrics once; vLLM's counters, or None when the server has no such route or no such counters."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except OSError:  # URLError, a refused connection, a timeout: no counters to read
        return None
    return spec_decode_counters(text)


def vllm_acceptance(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's acceptance from two counter reads (before may be None: a server that had not counted yet)."""
    if after is None:
        return None
    before = before or {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0, PER_POSITION: []}
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
    earlier = before[PER_POSITION] + [0.0] * (len(after[PER_POSITION]) - len(before[PER_POSITION]))
    accepted_at = [a - b for a, b in zip(after[PER_POSITION], earlier)]
    drafts = delta[DRAFTS]
    return {
        "drafts": int(drafts), "draft_tokens": int(delta[DRAFT_TOKENS]), "accepted_tokens": int(delta[ACCEPTED]),
        "mean_acceptance_length": 1.0 + delta[ACCEPTED] / drafts if drafts else None,
        "draft_acceptance_rate": delta[ACCEPTED] / delta[DRAFT_TOKENS] if delta[DRAFT_TOKENS] else None,
        # Share of verify steps whose draft at this position was accepted (vLLM's per-position rate).
        "acceptance_rate_by_position": [count / drafts for count in accepted_at] if drafts else None,
    }
