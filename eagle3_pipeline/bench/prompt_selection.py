"""Which benchmark prompts a run uses: --num-prompts N as a sample spread evenly over the categories.

(Not to be confused with eagle3_pipeline/bench/sampling.py, which samples tokens.)

The first N lines of a prompt file are usually one or two categories (MT-bench is sorted: its first 10
questions are all "writing"), so a short run would measure a drafter on one kind of text only. Instead the
categories take turns (round-robin, in the order they first appear in the file), each giving its next
prompt from its own list shuffled with --seed; a category that runs out drops out of the rotation. The
per-category counts therefore differ by at most one, unless a category has fewer prompts than its share.
Prompts without a category count as one category. N at or above the file's size keeps every prompt, in file
order. The same file, N and seed always give the same prompts.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

NO_CATEGORY = "(none)"  # the key of prompts without a category in the per-category counts


def select_prompts(prompts: Sequence[Any], num_prompts: int | None, seed: int = 0) -> tuple[list, dict[str, Any]]:
    """(chosen prompts, selection record) for --num-prompts `num_prompts` (None: all) and --seed `seed`.

    `prompts` need `.id` and `.category` (eagle3_pipeline.data.prompt_files.BenchPrompt). The chosen prompts come in the
    order they were picked (one per category per round). The record, written into the reports: method, seed,
    requested, available, chosen, ids (in run order) and per_category (category -> count, file order).
    """
    prompts = list(prompts)
    if num_prompts is not None and num_prompts > len(prompts):
        from eagle3_pipeline.log import get_logger

        get_logger().warning("--num-prompts %d: there are only %d prompts; all of them are used", num_prompts,
                             len(prompts))
    if num_prompts is None or num_prompts >= len(prompts):
        chosen, method = prompts, "all prompts, in file order"
    else:
        groups: dict[str, list] = {}
        for prompt in prompts:  # dicts keep insertion order: categories in order of first appearance
            groups.setdefault(_category(prompt), []).append(prompt)
        rng = random.Random(seed)
        queues = []
        for members in groups.values():
            members = list(members)
            rng.shuffle(members)
            queues.append(members)
        chosen = []
        while len(chosen) < num_prompts:
            for queue in queues:
                if queue and len(chosen) < num_prompts:
                    chosen.append(queue.pop(0))
        method = "round-robin over categories, each category's prompts shuffled with --seed"
    per_category: dict[str, int] = {}
    for prompt in prompts:  # every category of the file, in file order, zero when none was chosen
        per_category.setdefault(_category(prompt), 0)
    for prompt in chosen:
        per_category[_category(prompt)] += 1
    record = {"method": method, "seed": seed, "requested": num_prompts, "available": len(prompts),
              "chosen": len(chosen), "ids": [str(p.id) for p in chosen], "per_category": per_category}
    return chosen, record


def _category(prompt) -> str:
    return NO_CATEGORY if prompt.category is None else str(prompt.category)


def selection_summary(record: dict[str, Any]) -> str:
    """One line for the log: how many prompts of how many, how, and the per-category counts."""
    counts = ", ".join(f"{name} {count}" for name, count in record["per_category"].items())
    how = record["method"] + (f" (seed {record['seed']})" if record["chosen"] < record["available"] else "")
    return f"{record['chosen']} of {record['available']} prompts: {how}; per category: {counts}"
