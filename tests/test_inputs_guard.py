"""Nothing lost, nothing misread (issue 41, items 4, 5 and 7): a refused rerun keeps the earlier output, a damaged
file is named with the command that gets it whole, and what used to pass in silence is said.

Real stages on stories260K, as processes: one run directory (stages 01-04) is made once per module and copied
where a test damages or replaces something.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, STORIES_TEMPLATE, run_script

TEMPLATE_FILE = REPO / "tests" / "assets" / "stories260K_chat.jinja"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def chat(prompt: str, reply: str | None) -> dict:
    turns = [{"from": "human", "value": prompt}] + ([{"from": "gpt", "value": reply}] if reply is not None else [])
    return {"conversations": turns}


def good_chats(n: int) -> list[dict]:
    return [chat(f"Tell me about the little dog number {i}.", f"The dog {i} liked to play in the park.")
            for i in range(n)]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a folder (not the stage's log or lock) by name, with its bytes."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".lock"}


def prepare(model: Path, dataset: Path, out: Path, *extra: str):
    return run_script("01_prepare_data.py", "--model-path", str(model), "--chat-template", str(TEMPLATE_FILE),
                      "--dataset", str(dataset), "--output-dir", str(out), *extra, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory, stories260k) -> Path:
    """A run directory with stages 01-04 complete (stories260K, 20 short chats, one epoch)."""
    folder = tmp_path_factory.mktemp("guard")
    data = write_jsonl(folder / "chats.jsonl", good_chats(20))
    done = subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "--run-dir", str(folder / "run"),
                           "--model-path", str(stories260k), "--chat-template", str(TEMPLATE_FILE), "--dataset",
                           str(data), "--draft-vocab-size", "100", "--epochs", "1", "--skip", "05"],
                          capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder / "run"


def copy_of(run: Path, target: Path) -> Path:
    shutil.copytree(run, target, symlinks=True)  # best and latest stay links to their checkpoint
    for lock in target.rglob(".lock"):
        lock.unlink()
    return target


def said(result) -> str:
    return result.stdout + result.stderr


# --- item 4: a refused rerun keeps the earlier output -------------------------------------------------------------

@pytest.mark.parametrize("replacement", ["empty", "mostly_unreadable", "no_replies"])
def test_a_refused_overwrite_of_stage_01_keeps_the_earlier_output(tmp_path, stories260k, replacement):
    out = tmp_path / "data"
    first = prepare(stories260k, write_jsonl(tmp_path / "good.jsonl", good_chats(10)), out)
    assert first.returncode == 0, said(first)
    before = snapshot(out)
    assert {"tokenized_data.jsonl", "manifest.json", "train_prompt_hashes.txt", "bad_records.jsonl"} <= set(before)

    rows = {"empty": [],
            "mostly_unreadable": good_chats(2) + ["{broken"] * 8,  # refused while reading
            "no_replies": [chat(f"Question {i}?", None) for i in range(8)] + good_chats(2)}[replacement]  # processing
    second = prepare(stories260k, write_jsonl(tmp_path / "new.jsonl", rows), out, "--overwrite")

    assert second.returncode == 2, said(second)
    assert "Traceback" not in said(second)
    after = snapshot(out)
    refused = after.pop("bad_records.refused.jsonl", None)
    after.pop("01_prepare_data.config.json"), before.pop("01_prepare_data.config.json")
    assert after == before  # every file of the earlier output, byte for byte
    if replacement != "empty":
        assert refused is not None and len(refused.decode().splitlines()) == 8
    # The stages after it still take that output.
    vocab = run_script("03_build_vocab_mapping.py", "--prepared-data", str(out / "tokenized_data.jsonl"),
                       "--output-dir", str(tmp_path / "vocab"), "--draft-vocab-size", "100", timeout=300)
    assert vocab.returncode == 0, said(vocab)


def test_a_refused_overwrite_of_stage_03_keeps_its_map(run, tmp_path):
    run = copy_of(run, tmp_path / "run")
    before = snapshot(run / "vocab")
    # Other prepared data, whose last sample was cut off mid-line (a full disk, a copy stopped early).
    other = tmp_path / "other_data"
    shutil.copytree(run / "data", other)
    lines = (other / "tokenized_data.jsonl").read_text().splitlines(keepends=True)
    (other / "tokenized_data.jsonl").write_text("".join(lines[:-1]) + lines[-1][:40])

    result = run_script("03_build_vocab_mapping.py", "--prepared-data", str(other / "tokenized_data.jsonl"),
                        "--output-dir", str(run / "vocab"), "--draft-vocab-size", "100", "--overwrite", timeout=300)

    assert result.returncode == 2, said(result)
    assert f"{other / 'tokenized_data.jsonl'}:{len(lines)}: not valid JSON" in said(result)
    after = snapshot(run / "vocab")
    after.pop("03_build_vocab_mapping.config.json"), before.pop("03_build_vocab_mapping.config.json")
    assert after == before
    assert json.loads(after["manifest.json"])["status"] == "complete"


# --- item 5: a damaged file is named with the command that makes it whole -----------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "random_bytes"])
def test_a_damaged_vocabulary_map_is_named_with_the_command_that_rebuilds_it(run, tmp_path, damage):
    run = copy_of(run, tmp_path / "run")
    mapping = run / "vocab" / "vocab_mapping.safetensors"
    whole = mapping.read_bytes()
    mapping.write_bytes(whole[:len(whole) // 2] if damage == "truncated" else bytes(range(256)) * 8)
    checkpoints = snapshot(run / "checkpoints" / "epoch_1")

    result = run_script("04_train.py", "--run-dir", str(run), "--epochs", "1", "--overwrite", timeout=300)

    assert result.returncode == 2, said(result)
    assert f"{mapping}: not a whole vocabulary map" in said(result) and "Traceback" not in said(result)
    assert snapshot(run / "checkpoints" / "epoch_1") == checkpoints  # refused before anything was cleared
    command = said(result).split("Rebuild it: python ", 1)[1].splitlines()[0].split()
    assert command[0] == "03_build_vocab_mapping.py"
    assert command[command.index("--output-dir") + 1] == str(run / "vocab")
    rebuilt = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert rebuilt.returncode == 0, said(rebuilt)
    assert mapping.read_bytes() == whole


DRAFTER_DAMAGE = {
    "weights_truncated": ("model.safetensors", lambda b: b[:len(b) // 3], "not a whole safetensors file"),
    "config_truncated": ("config.json", lambda b: b[:50], "not a readable drafter config"),
    "config_random_bytes": ("config.json", lambda b: bytes(range(128, 256)) * 4, "not a readable drafter config"),
}


@pytest.mark.parametrize("damage", sorted(DRAFTER_DAMAGE))
def test_a_damaged_drafter_is_named_by_stage_05_and_check_drafter(run, tmp_path, stories260k, damage):
    drafter = tmp_path / "drafter"
    shutil.copytree(run / "checkpoints" / "best", drafter)  # as `cp -rL best` copies it out of its run
    name, damaged, words = DRAFTER_DAMAGE[damage]
    (drafter / name).write_bytes(damaged((drafter / name).read_bytes()))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Once upon a time"}])

    bench = run_script("05_benchmark.py", "--model-path", str(stories260k), "--chat-template", str(TEMPLATE_FILE),
                       "--draft-model-path", str(drafter), "--prompts", str(prompts), "--output-dir",
                       str(tmp_path / "bench"), "--num-steps", "2", "--max-new-tokens", "4", "--allow-overlap",
                       timeout=300)
    check = run_script("scripts/check_drafter.py", str(drafter), "--model-path", str(stories260k), timeout=120)

    for result in (bench, check):
        assert result.returncode == 2, said(result)
        assert f"{drafter / name}: {words}" in said(result) and "Traceback" not in said(result)
        assert "04_train.py" in said(result)  # what writes a whole one
    assert "does not fit" not in said(bench)


@pytest.fixture()
def sharded_verifier(tmp_path, stories260k) -> Path:
    """stories260K saved again in several safetensors shards, with their model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(stories260k).save_pretrained(folder, max_shard_size="300KB")
    for file in stories260k.iterdir():
        if file.name.startswith("tokenizer") or file.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(file, folder / file.name)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.mark.parametrize("damage", ["truncated", "shard_missing"])
def test_a_damaged_verifier_shard_index_is_named_before_any_work(run, tmp_path, sharded_verifier, damage):
    index = sharded_verifier / "model.safetensors.index.json"
    if damage == "truncated":
        index.write_text(index.read_text()[:100])
    else:
        shard = sorted(json.loads(index.read_text())["weight_map"].values())[-1]
        (sharded_verifier / shard).unlink()
    run = copy_of(run, tmp_path / "run")

    extract = run_script("02_extract_hidden_states.py", "--model-path", str(sharded_verifier), "--prepared-data",
                         str(run / "data" / "tokenized_data.jsonl"), "--output-dir", str(tmp_path / "states"),
                         timeout=300)
    train = run_script("04_train.py", "--run-dir", str(run), "--model-path", str(sharded_verifier), "--epochs", "1",
                       "--overwrite", timeout=300)

    for result in (extract, train):
        assert result.returncode == 2, said(result)
        assert str(index) in said(result) and "hf download" in said(result) and "Traceback" not in said(result)
    assert not (tmp_path / "states" / "manifest.json").exists()


# --- item 7: said, not silent ----------------------------------------------------------------------------------

PEAK_MEMORY = """
import resource, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code
print("PEAK_RSS_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "EXIT", code)
"""


def peak_memory_of_stage01(tmp_path, stories260k, reply: str, name: str) -> int:
    """Stage 01's peak resident memory (MB) on one chat with this reply and four good ones; it must succeed."""
    data = write_jsonl(tmp_path / f"{name}.jsonl", [chat("Tell me a long story.", reply)] + good_chats(4))
    result = subprocess.run(
        [sys.executable, "-c", PEAK_MEMORY, str(REPO / "01_prepare_data.py"), "--model-path", str(stories260k),
         "--chat-template", str(TEMPLATE_FILE), "--dataset", str(data), "--output-dir", str(tmp_path / name),
         "--max-seq-len", "512"], capture_output=True, text=True, timeout=600, cwd=str(REPO))
    peak_mb, code = (int(x) for x in said(result).split("PEAK_RSS_MB ")[1].split()[::2][:2])
    assert code == 0, said(result)
    return peak_mb


def test_a_huge_record_is_cut_before_it_is_tokenized(tmp_path, stories260k):
    from transformers import AutoTokenizer

    story = "Once upon a time there was a little dog who liked to play in the park. "
    huge = story * (10_000_000 // len(story))  # one 10 MB reply; --max-seq-len keeps 512 tokens of it
    peak_10mb = peak_memory_of_stage01(tmp_path, stories260k, huge, "out")
    peak_20mb = peak_memory_of_stage01(tmp_path, stories260k, huge + huge, "out20")
    # Tokenizing a whole reply costs about 140 MB per MB of text (1.4 GB for these 10 MB): a record cut first
    # costs about what its raw text does, whatever else the machine's Python holds.
    assert peak_20mb - peak_10mb < 200, f"peak memory {peak_10mb} MB at 10 MB, {peak_20mb} MB at 20 MB"
    samples = [json.loads(line) for line in (tmp_path / "out" / "tokenized_data.jsonl").read_text().splitlines()]
    longest = max(samples, key=lambda s: len(s["input_ids"]))
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    tokenizer.chat_template = STORIES_TEMPLATE
    messages = [{"role": "user", "content": "Tell me a long story."}, {"role": "assistant", "content": huge[:50_000]}]
    expected = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert longest["input_ids"] == expected["input_ids"][:512]
    assert sum(longest["loss_mask"]) > 480  # the reply's tokens are learned from


def test_every_unusable_record_counts_against_max_bad_fraction(tmp_path, stories260k):
    # 10 records: 2 unreadable, 4 without a reply, 4 usable: 60 % unusable.
    rows = ["{broken"] * 2 + [chat(f"Question {i}?", None) for i in range(4)] + good_chats(4)
    data = write_jsonl(tmp_path / "data.jsonl", rows)

    refused = prepare(stories260k, data, tmp_path / "out", "--max-bad-fraction", "0.5")
    assert refused.returncode == 2, said(refused)
    assert "60.0% of the records are unusable (6 of 10 records)" in said(refused)
    assert "invalid_json: 2" in said(refused) and "no_assistant_turn: 4" in said(refused)

    taken = prepare(stories260k, data, tmp_path / "out", "--max-bad-fraction", "0.7")
    assert taken.returncode == 0, said(taken)
    fraction = json.loads((tmp_path / "out" / "manifest.json").read_text())["bad_records"]["fraction"]
    assert fraction["unusable"] == pytest.approx(0.6)


def test_num_samples_beyond_the_data_is_warned(tmp_path, stories260k):
    data = write_jsonl(tmp_path / "data.jsonl", good_chats(6) + good_chats(2))  # 2 exact duplicates
    result = prepare(stories260k, data, tmp_path / "out", "--num-samples", "100")
    assert result.returncode == 0, said(result)
    assert "WARNING --num-samples 100: the data gave only 6 usable conversation(s) (of 8 record(s) read" in said(result)


def test_stage_05_warns_of_prompts_without_turns_and_of_num_prompts_beyond_them(run, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": []}, {"turns": ["Once upon a time"]},
                                                       {"turns": [""]}, {"turns": ["The little dog"]}])
    result = run_script("05_benchmark.py", "--run-dir", str(run), "--prompts", str(prompts), "--output-dir",
                        str(tmp_path / "bench"), "--num-prompts", "5", "--num-steps", "2", "--max-new-tokens", "4",
                        "--allow-overlap", "--tau-only", timeout=600)
    assert result.returncode == 0, said(result)
    assert (f"WARNING --prompts {prompts}: 2 record(s) without a non-empty turn are left out "
            f"(e.g. {prompts}:1, {prompts}:3)") in said(result)
    assert "WARNING --num-prompts 5: there are only 2 prompts; all of them are used" in said(result)


def test_stage_04_on_cpu_says_float16_is_not_used_and_clears_a_killed_runs_drawing(run, tmp_path):
    run = copy_of(run, tmp_path / "run")
    # What a run killed while drawing its curves leaves (eagle3_pipeline.formats.files.atomic_path's temporary name).
    stale = run / "checkpoints" / ".training_curves.png.k1ll3d.tmp"
    stale.write_bytes(b"\x89PNG half")

    result = run_script("04_train.py", "--run-dir", str(run), "--epochs", "1", "--dtype", "float16", "--overwrite",
                        timeout=600)

    assert result.returncode == 0, said(result)
    assert "WARNING --dtype float16: stage 04 trains in bfloat16 or float32" in said(result)
    assert "on cpu the drafter trains in float32" in said(result)
    assert not stale.exists() and (run / "checkpoints" / "training_curves.png").is_file()
