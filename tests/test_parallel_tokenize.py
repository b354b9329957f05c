"""Stage 01 tokenizing its rounds in worker processes (EAGLE3_TOKENIZE_WORKERS) writes exactly what the serial
path writes: the same samples in the same order, the same bad records, the same counts."""
from __future__ import annotations

import json
import re
from itertools import islice
from pathlib import Path

import pytest

from conftest import run_script

SCRIPT = "01_prepare_data.py"
SHAREGPT_CONVERSATIONS = 400
OUTPUTS = ("tokenized_data.jsonl", "eval_data.jsonl", "bad_records.jsonl")


def sharegpt(*turns: str, **extra) -> dict:
    """Turns alternate human, gpt from the first."""
    return {**extra, "conversations": [{"from": ("human", "gpt")[i % 2], "value": text} for i, text in enumerate(turns)]}


def marked_template(tokenizer_folder: Path) -> str:
    """SmolLM2's ChatML template with planted faults, each set off by a word in the content: RAISEME raises,
    SPLITME renders a reply differently once it is history (a turn split into its own sample), DROPME after a
    user turn adds text to the generation prompt only (a turn with no token boundary there: dropped)."""
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(tokenizer_folder).chat_template
    template = template.replace(
        "message['content']", "(('[old] ' if message['role'] == 'assistant' and not loop.last and 'SPLITME' in "
                              "message['content'] else '') + message['content'])")
    template = template.replace("{{ '<|im_start|>assistant\n' }}",
                                "{{ '<|im_start|>assistant\n' + ('[think]' if 'DROPME' in messages[-1]['content'] "
                                "else '') }}")
    assert "SPLITME" in template and "DROPME" in template, "SmolLM2's template changed: plant the faults anew"
    raises = ("{% for message in messages %}{% if 'RAISEME' in message['content'] %}"
              "{{ raise_exception('planted template error') }}{% endif %}{% endfor %}")
    return raises + template


def planted_records() -> list:
    rows = []
    for i in range(5):
        # a split turn, and the same first turn alone: its sample repeats the split one (a repeated sample)
        rows.append(sharegpt(f"Question {i} SPLITME?", f"Answer {i} SPLITME.", "And then?", f"Then {i}."))
        rows.append(sharegpt(f"Question {i} SPLITME?", f"Answer {i} SPLITME."))
        # a trailing user turn is cut, so this repeats a sample too
        rows.append(sharegpt(f"Say {i}.", f"{i}.", "Thanks!"))
        rows.append(sharegpt(f"Say {i}.", f"{i}."))
    rows += [sharegpt("First DROPME", "Dropped reply.", "Second", "Kept reply."),  # one turn dropped, one kept
             sharegpt("Only DROPME", "Nothing kept."),                              # template_not_prefix_stable
             sharegpt("RAISEME please", "No render."),                              # template_error
             sharegpt("word " * 3000, "Too late."),                                 # no_loss_tokens_after_truncation
             {"text": "A plain text: loss on every token."},
             "{broken"]                                                             # invalid_json, when read
    return rows


def run(data: Path, template: Path, model: Path, out: Path, workers: int) -> dict:
    result = run_script(SCRIPT, "--model-path", str(model), "--chat-template", str(template), "--dataset", str(data),
                        "--output-dir", str(out), "--max-seq-len", "1024", "--eval-ratio", "0.05", "--seed", "7",
                        env={"EAGLE3_TOKENIZE_WORKERS": str(workers)}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "manifest.json").read_text())


def test_worker_processes_write_exactly_what_the_serial_path_writes(tmp_path, smollm2, sharegpt_path):
    from eagle3_pipeline.data.sources import iter_json_array

    conversations = [item for _, item in islice(iter_json_array(sharegpt_path), SHAREGPT_CONVERSATIONS)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in conversations + planted_records()))
    template = tmp_path / "marked.jinja"
    template.write_text(marked_template(smollm2))

    serial = run(data, template, smollm2, tmp_path / "serial", workers=0)
    parallel = run(data, template, smollm2, tmp_path / "parallel", workers=2)

    for name in OUTPUTS:
        assert (tmp_path / "parallel" / name).read_bytes() == (tmp_path / "serial" / name).read_bytes(), name
    assert parallel["counts"] == serial["counts"]
    assert parallel["bad_records"] == serial["bad_records"]
    # the pool did the work in one run only
    assert "tokenizing in 2 worker processes" in (tmp_path / "parallel" / "logs" / "01_prepare_data.log").read_text()
    assert "worker processes" not in (tmp_path / "serial" / "logs" / "01_prepare_data.log").read_text()
    # and the planted cases were there to compare
    counts, bad = serial["counts"], serial["bad_records"]["counts"]
    assert counts["split_turn_samples"] >= 4 and counts["dropped_turns"] == 2
    assert counts["duplicate_samples_removed"] >= 4 and counts["eval_samples"] > 0
    assert {"template_error", "template_not_prefix_stable", "no_loss_tokens_after_truncation",
            "invalid_json"} <= set(bad)


def test_the_worker_count_is_read_from_the_environment(monkeypatch):
    from eagle3_pipeline.data.parallel_tokenize import POOL_MIN_RECORDS, ParallelTokenizer, tokenize_workers
    from eagle3_pipeline.errors import UsageError

    monkeypatch.setenv("EAGLE3_TOKENIZE_WORKERS", "3")
    assert tokenize_workers() == (3, True) and ParallelTokenizer(None).pays(6)
    monkeypatch.setenv("EAGLE3_TOKENIZE_WORKERS", "1")
    assert not ParallelTokenizer(None).pays(100_000)  # one process: serial
    monkeypatch.delenv("EAGLE3_TOKENIZE_WORKERS")
    workers, explicit = tokenize_workers()
    assert not explicit and 0 <= workers <= 8
    assert not ParallelTokenizer(None).pays(POOL_MIN_RECORDS - 1)  # a small round stays in the stage's process
    monkeypatch.setenv("EAGLE3_TOKENIZE_WORKERS", "many")
    with pytest.raises(UsageError, match="EAGLE3_TOKENIZE_WORKERS='many'"):
        tokenize_workers()


# --- with --regenerate: a round tokenized while the next one regenerates ----------------------------------------

def regenerate_rows() -> list:
    """48 stories prompts, and beside them what stage 01 counts: two replies to one prompt that greedy
    regeneration makes the same (a repeated sample), prompts too long for --max-seq-len (bad while
    regenerating), a plain text, and a line that does not read."""
    starts = ["Lily found a", "Tom saw a big", "The cat and the dog", "One sunny day", "A little bird", "Sue had a red"]
    rows = [sharegpt(f"{start} {thing}") for start in starts for thing in ("ball", "tree", "hat", "cup", "box",
                                                                            "boat", "cake", "dog")]
    rows += [sharegpt("Lily found a kite", "One reply."), sharegpt("Lily found a kite", "Another reply.")]
    rows += [sharegpt("word " * 400 + str(i)) for i in range(3)]
    return rows + [{"text": "Once upon a time there was a cat."}, "{broken"]


def rounds_in_order(monkeypatch) -> list[str]:
    """Rounds of 8 records (stage 01 in this process); the list gets "start" and "finish" as rounds do."""
    from eagle3_pipeline.data import processing

    monkeypatch.setattr(processing, "CHUNK_RECORDS", 8)
    monkeypatch.setattr(processing, "REGEN_SORT_BATCHES", 2)
    events: list[str] = []
    start, finish = processing.Processor.start, processing.Processor.finish
    monkeypatch.setattr(processing.Processor, "start", lambda self, *a: events.append("start") or start(self, *a))
    monkeypatch.setattr(processing.Processor, "finish", lambda self, p: events.append("finish") or finish(self, p))
    return events


def run_regenerating(stage, monkeypatch, stories260k, data: Path, template: Path, out: Path, workers: int) -> None:
    monkeypatch.setenv("EAGLE3_TOKENIZE_WORKERS", str(workers))
    assert stage.main(["--model-path", str(stories260k), "--chat-template", str(template), "--dataset", str(data),
                       "--output-dir", str(out), "--regenerate", "--device", "cpu", "--dtype", "float32",
                       "--max-seq-len", "256", "--max-new-tokens", "4", "--batch-size", "2", "--eval-ratio", "0.1",
                       "--seed", "3"]) == 0


@pytest.mark.usefixtures("one_intra_op_thread")
def test_regenerated_rounds_tokenized_behind_the_next_round_write_what_the_serial_path_writes(
        tmp_path, monkeypatch, stories260k):
    from conftest import STORIES_TEMPLATE
    from test_prepare_data import load_stage

    stage = load_stage()
    data = tmp_path / "data.jsonl"
    data.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in regenerate_rows()))
    template = tmp_path / "stories.jinja"
    template.write_text(STORIES_TEMPLATE)

    events = rounds_in_order(monkeypatch)
    run_regenerating(stage, monkeypatch, stories260k, data, template, tmp_path / "serial", 0)
    serial_events = events[:]
    events.clear()
    run_regenerating(stage, monkeypatch, stories260k, data, template, tmp_path / "parallel", 2)

    for name in OUTPUTS:
        assert (tmp_path / "parallel" / name).read_bytes() == (tmp_path / "serial" / name).read_bytes(), name
    serial, parallel = (json.loads((tmp_path / run / "manifest.json").read_text()) for run in ("serial", "parallel"))
    assert parallel["counts"] == serial["counts"] and parallel["bad_records"] == serial["bad_records"]
    # the eval split goes round by round (its rounds depend on what the last one accepted); the train split's
    # round k is counted only once round k + 1 has regenerated, in both runs
    assert events == serial_events
    log = (tmp_path / "parallel" / "logs" / "01_prepare_data.log").read_text()
    assert "tokenizing in 2 worker processes" in log and "each round while the next regenerates" in log
    # the pool was started before the first round (warm()), not when that round's tokenizing came
    assert log.index("tokenizing in 2 worker processes") < log.index("eval split: taking")
    rounds = len(re.findall(r"regenerate train split, round \d+: \d+ conversation\(s\) in", log))
    assert rounds >= 3 and events[-2 * rounds:] == ["start"] + ["start", "finish"] * (rounds - 1) + ["finish"]
    # the cases to compare were there
    counts = serial["counts"]
    assert counts["duplicate_samples_removed"] >= 1 and counts["eval_samples"] > 0
    assert serial["bad_records"]["counts"], serial["bad_records"]


# --- warm(): the workers start before the first round -----------------------------------------------------------

def test_warm_starts_every_worker_before_a_round_is_submitted(monkeypatch, stories260k):
    import multiprocessing

    from transformers import AutoTokenizer

    from conftest import STORIES_TEMPLATE
    from eagle3_pipeline.data.chat_tokenizer import ChatTokenizer, end_of_turn_ids
    from eagle3_pipeline.data.parallel_tokenize import ParallelTokenizer, tokenize_one
    from eagle3_pipeline.data.records import Record

    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    tokenizer.chat_template = STORIES_TEMPLATE
    chat = ChatTokenizer(tokenizer, end_of_turn_ids(tokenizer, str(stories260k)), 256)
    records = [Record(f"r{i}", "test", i, messages=[{"role": "user", "content": f"Tell me a story {i}."},
                                                     {"role": "assistant", "content": f"Once upon a time {i}."}])
               for i in range(12)]
    serial = [tokenize_one(chat, record) for record in records]

    monkeypatch.setenv("EAGLE3_TOKENIZE_WORKERS", "2")
    tokenize = ParallelTokenizer(chat)
    try:
        warming = tokenize.warm()
        assert warming is not None and tokenize._pool is not None
        # warm() returned before its workers started: each imports transformers first, which takes seconds
        assert not warming.done()
        # each warming task ran on its own worker, after that worker's initializer, with no round submitted
        pids = set(warming.result(timeout=300))
        assert len(pids) == 2 and pids <= {child.pid for child in multiprocessing.active_children()}
        handle = tokenize.submit(records)
        assert len(handle) > 1 and tokenize.collect(handle) == serial
    finally:
        tokenize.close()

    monkeypatch.setenv("EAGLE3_TOKENIZE_WORKERS", "1")
    alone = ParallelTokenizer(chat)
    assert alone.warm() is None and alone._pool is None  # one process: nothing starts
