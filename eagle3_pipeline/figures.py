"""The two figures stage 04's validation gives, under the one name each that every log line, report, plot and
--status line uses (the README defines them, "tau"), and how a figure is written. Their keys in metrics.jsonl and
the JSON reports stay `sim_chain_tau` and `sim_accept_len`."""
from __future__ import annotations

import math
from typing import Any

# Drafts a verify step of the walked chain: SGLang's default chain, which the launch command serves
# (eagle3_pipeline.verifier.sglang_launch.DEFAULT_NUM_STEPS is this number).
CHAIN_DRAFTS = 3
# Greedy chain decoding with CHAIN_DRAFTS drafts a verify step, walked over the teacher-forced predictions: the
# figure to compare with stage 05's tau, so it is always named first.
WALKED_CHAIN_TAU = "walked chain tau"
# 1 + sum_k prod_{j<=k} acc_j over the TTT steps: every TTT step taken for a draft, independent of the others;
# it picks the `best` checkpoint and overstates what decoding accepts.
TTT_ESTIMATE = "TTT acceptance estimate"


def figures_text(record: dict[str, Any], digits: int = 3) -> str:
    """'walked chain tau 1.255, TTT acceptance estimate 1.290' from a metrics record; a figure the record
    lacks (training windows have no walk) is left out."""
    parts = []
    for name, key in ((WALKED_CHAIN_TAU, "sim_chain_tau"), (TTT_ESTIMATE, "sim_accept_len")):
        value = record.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{name} {value:.{digits}f}")
    return ", ".join(parts)


def fmt(value: Any, digits: int = 3) -> str:
    """A number as reports and log lines write it: `digits` decimals for a float, "-" when missing or NaN."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)
