"""Stage 01 tokenizing its rounds in worker processes (EAGLE3_TOKENIZE_WORKERS) writes exactly what the serial
path writes: the same samples in the same order, the same bad records, the same counts."""
from __future__ import annotations

import json
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
