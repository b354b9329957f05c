"""Progress lines (issue 45, item 3): stage 01's regeneration counts the tokens it generates, its ETA comes from the
share of the decoding work done and does not rise while tokens flow, and nested progress writes one line per
interval."""
from __future__ import annotations

import json
import random
import re
import time
from collections import Counter

import pytest

from conftest import STORIES_TEMPLATE, run_script
from eagle3_pipeline.errors import UsageError

INTERVAL = 0.25
BATCH = 4
LINE = re.compile(r"^(\S+ \S+) INFO (regenerate train split, round (\d+)): (\d+)/(\d+) \([\d.]+%\)"
                  r"(?:, ETA (\d+):(\d+))?.*?, ([\d,]+) tokens generated .*?(\d+)/(\d+) conversations done, "
                  r"batch (\d+) of (\d+)(.*)$")
START = re.compile(r"(regenerate train split, round \d+): (\d+) conversation\(s\) in (\d+) batch\(es\)")


def write_prompts(path, count: int, long_every: int) -> int:
    """Short ShareGPT prompts, one in `long_every` too long for --max-seq-len 256 (no reply: dropped, so the
    split takes more in a second round); returns how many are long."""
    rng = random.Random(0)
    words = "the cat dog sun park ball girl boy tree big red happy ran saw played".split()
    rows = []
    for i in range(count):
        text = " ".join(rng.choice(words) for _ in range(300 if i % long_every == 0 else rng.randint(3, 12)))
        rows.append({"id": f"c{i}", "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "x"}]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return sum(1 for i in range(count) if i % long_every == 0)


def test_stage01_regeneration_counts_tokens_and_its_eta_does_not_rise(tmp_path, stories260k):
    data, template, out = tmp_path / "prompts.jsonl", tmp_path / "template.jinja", tmp_path / "out"
    write_prompts(data, 40, 5)
    template.write_text(STORIES_TEMPLATE)
    result = run_script("01_prepare_data.py", "--model-path", str(stories260k), "--chat-template", str(template),
                        "--dataset", str(data), "--output-dir", str(out), "--regenerate", "--max-new-tokens", "96",
                        "--batch-size", str(BATCH), "--device", "cpu", "--dtype", "float32", "--max-seq-len", "256",
                        "--num-samples", "26", "--max-bad-fraction", "0.5",
                        env={"EAGLE3_PROGRESS_INTERVAL": str(INTERVAL)}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (out / "logs" / "01_prepare_data.log").read_text().splitlines()
    starts = {m[1]: (int(m[2]), int(m[3])) for m in map(START.search, log) if m}
    lines = [m for m in map(LINE.match, log) if m]
    first_round = [m for m in lines if m[3] == "1"]
    assert len(first_round) >= 4, "\n".join(log[-40:])

    # Tokens are counted as they are generated, and the ETA (of the work's upper bound left) never rises
    # while they flow (1 s: the line's rounding).
    tokens = [int(m[8].replace(",", "")) for m in first_round]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0] > 0
    etas = [(int(m[8].replace(",", "")), 60 * int(m[6]) + int(m[7])) for m in first_round if m[6] is not None]
    assert len(etas) >= 3
    for (tokens_before, eta_before), (tokens_after, eta_after) in zip(etas, etas[1:]):
        if tokens_after > tokens_before:
            assert eta_after <= eta_before + 1, (eta_before, eta_after)
    # The work's bound is replies x --max-new-tokens and only falls: batches that stop early take less.
    assert int(first_round[0][5]) <= 26 * 96 and int(first_round[-1][4]) == int(first_round[-1][5])

    # One line per interval: the split's own progress says nothing while the regeneration inside it speaks.
    first, last = log.index(first_round[0][0]), log.index(first_round[-1][0])
    assert not [line for line in log[first:last] if "INFO train split: " in line]
    per_second = Counter((m[1], m[3]) for m in lines)  # (the second, the round): a round's last line comes at once
    assert max(per_second.values()) <= 1 / INTERVAL + 1, per_second

    # The smaller last batch says what it holds; a second round says why it runs.
    for m in lines:
        conversations, batches = starts[m[2]]
        if int(m[11]) == batches > 1 and conversations % BATCH:
            assert f"(the last {conversations % BATCH} conversation(s): the longest prompts)" in m[13]
    assert any(int(m[11]) == int(m[12]) and m[13] for m in lines)
    dropped = json.loads((out / "manifest.json").read_text())["counts"]["bad_records"]
    second = [line for line in log if "train split, round 2: " in line and "more conversation(s)" in line]
    assert len(second) == 1 and dropped > 0
    assert re.search(r"round 2: (\d+) more conversation\(s\), in place of those round 1 dropped \(no_reply: \1\)",
                     second[0]), second[0]


@pytest.mark.parametrize("engine", ["generate", "loop"])
def test_a_responder_tells_its_listener_every_decoding_step(stories260k, engine):
    """The counts a listener gets add up to what the batches did: rows x steps, and the tokens up to each stop."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.verifier.loading import load_verifier_model

    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    tokenizer.chat_template = STORIES_TEMPLATE
    told = []
    responder = HFResponder(lambda device: load_verifier_model(str(stories260k), device, "float32"), tokenizer,
                            {tokenizer.eos_token_id}, 40, 0.0, 3, 256, devices=["cpu"], engine=engine)
    responder.listen(lambda token_steps, tokens: told.append((token_steps, tokens)))
    starts = ["Once upon a time", "The dog", "Lily and Tom went to the park and", "A big red", "One day"]
    responder([[{"role": "user", "content": text}] for text in starts])
    assert len(told) > len(responder.batch_log)  # during the batches, not only at their ends
    assert sum(steps for steps, _ in told) == sum(b["rows"] * b["steps"] for b in responder.batch_log)
    assert sum(tokens for _, tokens in told) == responder.generated_tokens > 0


def test_nested_progress_writes_one_line_per_interval(tmp_path):
    """A progress inside another (a regeneration inside a split's round) speaks for both while it is open."""
    from eagle3_pipeline.progress import Progress
    from eagle3_pipeline.cli.stage import setup_logging

    setup_logging("nested_test", tmp_path)
    with Progress(total=2, desc="outer", unit="round", interval=0.2) as outer:
        with Progress(total=10, desc="inner", unit="step", interval=0.2) as inner:
            for _ in range(10):
                time.sleep(0.1)
                inner.update(1)
        time.sleep(0.5)  # the inner one closed: the outer one's heartbeat speaks again
        outer.update(2)
    lines = (tmp_path / "nested_test.log").read_text().splitlines()
    last_inner = max(i for i, line in enumerate(lines) if "inner: " in line)  # its closing line
    inside, after = lines[:last_inner + 1], lines[last_inner + 1:]
    assert sum("inner: " in line for line in inside) >= 3
    assert not [line for line in inside if "outer: " in line]
    assert [line for line in after if "outer: 0/2" in line and "no item finished" in line]


def test_the_progress_interval_comes_from_the_environment(monkeypatch):
    from eagle3_pipeline.progress import PROGRESS_INTERVAL_ENV, Progress

    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, "0.5")
    with Progress(total=1, desc="env") as progress:
        assert progress.interval == 0.5
    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, "soon")
    with pytest.raises(UsageError, match="EAGLE3_PROGRESS_INTERVAL='soon'"):
        Progress(total=1, desc="env")
