"""Stage 05's prompt selection (--num-prompts, --seed) and the divergence measure of the greedy check.

Pure Python on a real prompt file in MT-bench's format (tests/assets: 24 two-turn questions, 8 categories of 3,
sorted by category).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import TWO_TURN_PROMPTS as MT_BENCH


@pytest.fixture(scope="module")
def mt_bench():
    from eagle3_pipeline.bench.prompts import load_prompts

    prompts = load_prompts(str(MT_BENCH))
    assert len(prompts) == 24 and len({p.category for p in prompts}) == 8
    return prompts


def test_a_sample_is_spread_evenly_over_the_categories(mt_bench):
    from eagle3_pipeline.bench.prompt_selection import select_prompts

    chosen, record = select_prompts(mt_bench, 16, seed=0)
    counts = Counter(p.category for p in chosen)
    assert len(chosen) == 16 and set(counts.values()) == {2} and len(counts) == 8  # 2 per category
    assert record["per_category"] == dict(counts) and sum(record["per_category"].values()) == 16
    assert record["ids"] == [str(p.id) for p in chosen] and len(set(record["ids"])) == 16
    assert record["chosen"] == 16 and record["available"] == 24 and record["seed"] == 0
    assert [p.id for p in chosen] != [p.id for p in mt_bench[:16]]  # not the first lines (writing, roleplay)

    chosen, record = select_prompts(mt_bench, 10, seed=0)
    counts = [record["per_category"][c] for c in dict.fromkeys(p.category for p in mt_bench)]
    assert sum(counts) == 10 and max(counts) - min(counts) <= 1 and min(counts) == 1


def test_the_sample_is_deterministic_for_a_seed_and_changes_with_it(mt_bench):
    from eagle3_pipeline.bench.prompt_selection import select_prompts

    ids = [p.id for p in select_prompts(mt_bench, 16, seed=0)[0]]
    assert ids == [p.id for p in select_prompts(list(mt_bench), 16, seed=0)[0]]
    other = [p.id for p in select_prompts(mt_bench, 16, seed=1)[0]]
    assert other != ids and Counter(p.category for p in select_prompts(mt_bench, 16, seed=1)[0]) == \
        Counter(p.category for p in select_prompts(mt_bench, 16, seed=0)[0])
    # Within a category the order is shuffled, not the file's: over the seeds, not always the first two.
    writing = {tuple(p.id for p in select_prompts(mt_bench, 8, seed=s)[0] if p.category == "writing")
               for s in range(6)}
    assert len(writing) > 1


def test_all_prompts_keep_file_order_and_uncategorised_prompts_are_one_category(mt_bench, tmp_path):
    from eagle3_pipeline.bench.prompt_selection import NO_CATEGORY, select_prompts, selection_summary
    from eagle3_pipeline.bench.prompts import load_prompts

    for n in (None, 24, 500):
        chosen, record = select_prompts(mt_bench, n, seed=3)
        assert [p.id for p in chosen] == [p.id for p in mt_bench] and record["chosen"] == 24
        assert record["method"].startswith("all prompts")
    rows = [{"prompt": f"p{i}", "category": "a"} for i in range(4)] + [{"prompt": f"q{i}"} for i in range(6)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts(str(path))
    chosen, record = select_prompts(prompts, 6, seed=0)
    assert record["per_category"] == {"a": 3, NO_CATEGORY: 3}
    chosen, record = select_prompts(prompts, 9, seed=0)  # "a" runs out: the rest come from the other one
    assert record["per_category"] == {"a": 4, NO_CATEGORY: 5}
    line = selection_summary(record)
    assert "9 of 10 prompts" in line and "a 4" in line and f"{NO_CATEGORY} 5" in line and "seed 0" in line
    # load_prompts with num_prompts goes through the same selection.
    assert [p.id for p in load_prompts(str(path), num_prompts=6)] == [p.id for p in select_prompts(prompts, 6)[0]]


def test_first_divergence_and_share_before_it():
    from eagle3_pipeline.bench.metrics import first_divergence, share_before_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and share_before_divergence([1, 2, 3], [1, 2, 3]) == 1.0
    assert first_divergence([], []) is None and share_before_divergence([], []) == 1.0
    assert first_divergence([1, 2, 9, 4], [1, 2, 3, 4]) == 2 and share_before_divergence([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert first_divergence([7, 2], [1, 2]) == 0 and share_before_divergence([7, 2], [1, 2]) == 0.0
    # One stops earlier (a wrong end of turn, or a missing one): they diverge where the shorter stops.
    assert first_divergence([1, 2], [1, 2, 3, 4]) == 2 and share_before_divergence([1, 2], [1, 2, 3, 4]) == 0.5
    assert first_divergence([1, 2, 3, 4, 5], [1, 2, 3, 4]) == 4
    assert share_before_divergence([1, 2, 3, 4, 5], [1, 2, 3, 4]) == pytest.approx(0.8)


def test_the_greedy_summary_counts_identical_turns_and_the_mean_share():
    from eagle3_pipeline.bench.metrics import summarize_generations

    def run(prompt_id, first, share, margin=None):
        return {"prompt_id": prompt_id, "turn": 0, "spec": {"accept_lengths": [2, 1], "new_tokens": 3, "wall_s": 1.0,
                                                              "tokens": [1, 2, 3]},
                "greedy_check": {"reference": "plain_decode", "first_divergence": first,
                                 "share_before_divergence": share, "logit_margin": margin,
                                 "tie": margin is not None and margin <= 0}}

    runs = [run("a", None, 1.0), run("b", 3, 0.25, 0.5), run("c", None, 1.0), run("d", 1, 0.5, -2e-5)]
    summary = summarize_generations(runs, 2)
    match = summary["greedy_match"]
    assert match["turns_checked"] == 4 and match["turns_identical"] == 2 and match["turns_parted_at_a_tie"] == 1
    assert match["mean_share_before_divergence"] == pytest.approx(0.6875)
    assert match["diverged"] == [
        {"prompt_id": "b", "turn": 0, "first_divergence": 3, "share_before_divergence": 0.25, "logit_margin": 0.5,
         "tie": False},
        {"prompt_id": "d", "turn": 0, "first_divergence": 1, "share_before_divergence": 0.5, "logit_margin": -2e-5,
         "tie": True}]
    # No baselines in the runs (--tau-only): no speedups and no baseline tokens/s, rather than None or 0.
    assert "speedup_vs_plain" not in summary and "speedup_vs_hf_generate" not in summary
    assert set(summary["tokens_per_s"]) == {"spec"} and summary["tau"] == 1.5
