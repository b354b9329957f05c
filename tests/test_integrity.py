"""Nothing silently wrong: damaged sample files, NaN/inf hidden states, two writers on one folder, another verifier
with the same shape, bytes that are not UTF-8, plain-text training data in the overlap check, a drafter vLLM would
feed other layers, a corrupt stage-02 manifest. Real stages on stories260K, real files, real processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, run_script
from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.files import read_json, write_json_atomic
from eagle3_pipeline.formats.hidden_states import AUX_FILES, FINAL_FILE, SAMPLE_FILES, load_sample, open_hidden_states
from test_extract import ONE_THREAD, STAGE_SCRIPT, all_tensors, extract, stage02, stage_log, write_prepared_data

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FLAGS = ["--aux-layers", "1,2,4", "--batch-size", "2"]


def entries_by_id(out: Path) -> dict[str, dict]:
    return {entry["id"]: entry for entry in open_hidden_states(out, require_complete=False)[1]}


# --- 1. damaged hidden states ------------------------------------------------------------------------------

def test_sizes_and_checksums_recorded_damage_found_named_and_redone(stories260k, tmp_path):
    from eagle3_pipeline.errors import StageFailure

    data = write_prepared_data(tmp_path / "data", stories260k, [12, 20, 9, 16])
    out = tmp_path / "out"
    assert extract(stories260k, data, out, *FLAGS) == 0
    pristine = all_tensors(out)
    entries = entries_by_id(out)
    for entry in entries.values():  # each file's size and CRC32, as on disk
        for name in SAMPLE_FILES:
            path = out / entry["path"] / name
            assert entry["files"][name] == {"bytes": path.stat().st_size, "crc32": zlib.crc32(path.read_bytes())}

    short, flipped = entries["sample-000"], entries["sample-002"]
    aux_1 = out / short["path"] / AUX_FILES[1]
    whole_size = aux_1.stat().st_size
    aux_1.write_bytes(aux_1.read_bytes()[:-100])  # cut short: torch.load fails
    final = out / flipped["path"] / FINAL_FILE
    content = bytearray(final.read_bytes())
    at = bytes(content).find(torch.load(final, weights_only=True).view(torch.uint8).numpy().tobytes()) + 10
    content[at] ^= 0x40  # one value changed: the same size, and torch.load reads it without complaint
    final.write_bytes(bytes(content))
    assert not torch.equal(torch.load(final, weights_only=True), pristine[str(final.relative_to(out))])

    # Stages 04 and 05 read samples through load_sample: the file and the repair commands, no bare error.
    with pytest.raises(StageFailure) as failure:
        load_sample(out, short)
    assert str(aux_1) in str(failure.value) and "--verify" in str(failure.value)
    assert f"--output-dir {out}" in str(failure.value) and "--aux-layers 1,2,4" in str(failure.value)

    # A rerun re-checks sizes: the short sample is named and redone; the flipped byte is not a size problem.
    assert extract(stories260k, data, out, *FLAGS) == 0
    text = stage_log(out)
    assert "1 samples were not whole and are redone" in text and "'sample-000'" in text
    assert f"{AUX_FILES[1]} is {whole_size - 100} bytes, {whole_size} were written" in text
    assert aux_1.stat().st_size == whole_size

    # --verify reads every byte: the flipped one is found, named by id and file, marked, and left out.
    verify = run_script(STAGE_SCRIPT, "--output-dir", str(out), "--verify", env=ONE_THREAD)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "1 of 4 samples" in verify.stdout and "'sample-002'" in verify.stdout and "final.pt: CRC32" in verify.stdout
    assert "loading the verifier" not in verify.stdout
    assert read_json(out / "manifest.json")["status"] == "damaged"
    with pytest.raises(UsageError, match="did not finish"):
        open_hidden_states(out)  # stages 04 and 05 refuse the folder until it is repaired
    assert "sample-002" not in entries_by_id(out)

    # The rerun it names redoes exactly that sample; the result equals the undamaged output.
    assert extract(stories260k, data, out, *FLAGS) == 0
    assert "found damaged by --verify" in stage_log(out)
    assert run_script(STAGE_SCRIPT, "--output-dir", str(out), "--verify", env=ONE_THREAD).returncode == 0
    after = all_tensors(out)
    assert after.keys() == pristine.keys()
    for name, tensor in after.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, pristine[name]), name


def test_corrupt_manifest_is_rebuilt_from_the_sample_folders(stories260k, tmp_path):
    data = write_prepared_data(tmp_path / "data", stories260k, [12, 20, 9, 16])
    out = tmp_path / "out"
    assert extract(stories260k, data, out, *FLAGS) == 0
    kept = {p: p.stat().st_ino for p in out.glob("shard_*/*/aux_0.pt")}
    lost = next(iter(kept))
    shutil.rmtree(lost.parent)  # one sample lost besides
    (out / "manifest.json").write_text('{"stage": "02_extract_hi')
    assert extract(stories260k, data, out, *FLAGS) == 2
    assert "--rebuild-manifest" in stage_log(out)
    assert extract(stories260k, data, out, *FLAGS, "--rebuild-manifest") == 0
    manifest, entries = open_hidden_states(out)
    assert manifest["status"] == "complete" and len(entries) == 4
    assert lost.exists()  # redone
    assert all(p.stat().st_ino == kept[p] for p in kept if p != lost)  # the others kept, not rewritten
    # ... but not for samples made with other settings
    (out / "manifest.json").write_text("{")
    config = out / "02_extract_hidden_states.config.json"
    config_before = config.read_text()
    assert extract(stories260k, data, out, "--aux-layers", "1,2,4", "--dtype", "float32", "--rebuild-manifest") == 2
    assert "were not made with these flags" in stage_log(out)
    assert config.read_text() == config_before  # a refused run leaves the configuration that made the output


# --- 2. non-finite hidden states ---------------------------------------------------------------------------

def poisoned_copy(stories260k: Path, target: Path, token: int) -> Path:
    """stories260K with one embedding row set to NaN: every sample holding that token turns NaN from layer 0."""
    shutil.copytree(stories260k, target)
    weights = load_file(target / "model.safetensors")
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name][token] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_nonfinite_states_stop_the_run_naming_sample_and_layer_or_are_skipped(stories260k, tmp_path):
    data = write_prepared_data(tmp_path / "data", stories260k, [12, 20, 9, 16])
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    others = {t for row in rows if row["id"] != "sample-002" for t in row["input_ids"]}
    token = next(t for t in rows[2]["input_ids"] if t not in others)
    model = poisoned_copy(stories260k, tmp_path / "poisoned", token)

    out = tmp_path / "out"
    assert extract(model, data, out, *FLAGS) == 1
    text = stage_log(out)
    assert "'sample-002': first in the input of decoder layer 1 (aux_0.pt)" in text
    assert "--skip-nonfinite" in text and "Traceback" not in text
    assert not any("sample-002" in p.name for p in out.glob("shard_*/*"))  # nothing of it reached the disk

    assert extract(model, data, out, *FLAGS, "--skip-nonfinite") == 0
    manifest, entries = open_hidden_states(out)
    assert manifest["counts"]["skipped_nonfinite"] == 1 and manifest["counts"]["samples"] == 3
    assert sorted(e["id"] for e in entries) == ["conv 1/turn:ü", "sample-000", "sample-003"]
    assert "left out: 'sample-002'" in stage_log(out)
    for entry in entries:
        sample = load_sample(out, entry)
        assert torch.isfinite(sample["aux"].float()).all() and torch.isfinite(sample["final"].float()).all()


def test_training_names_the_samples_of_a_nonfinite_step(stories260k, tmp_path):
    from test_train import _load_module, build_run, train_argv

    run = build_run(stories260k, tmp_path / "run", seed=3)
    entry = open_hidden_states(run / "hidden_states")[1][5]
    final = run / "hidden_states" / entry["path"] / FINAL_FILE
    values = torch.load(final, weights_only=True)
    values[3] = float("inf")  # as written by a stage 02 without the non-finite check, and without records
    torch.save(values, final)
    (final.parent / "files.json").unlink()
    out = tmp_path / "out"
    stage04 = _load_module("stage04_train", "04_train.py")
    stage04.main(train_argv(run, out, stories260k, epochs=1, val_ratio=0.0))
    text = (out / "logs" / "04_train.log").read_text()
    assert "non-finite loss or gradient norm; update skipped" in text
    assert f"NaN/inf in their stored hidden states: {entry['id']!r}" in text
    assert f"--output-dir {run / 'hidden_states'} --verify" in text and "extract again" not in text


# --- 3. one writer per output folder ------------------------------------------------------------------------

HOLD = ("import sys, time; from eagle3_pipeline.cli.lock import OutputLock; "
        "lock = OutputLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")


def hold_lock(folder: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=str(REPO), stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_is_refused_and_a_dead_ones_lock_taken_over(stories260k, tmp_path):
    data = write_prepared_data(tmp_path / "data", stories260k, [12, 9])
    out = tmp_path / "out"
    assert extract(stories260k, data, out, *FLAGS) == 0
    config = out / "02_extract_hidden_states.config.json"
    config_before = config.read_text()

    holder = hold_lock(out)
    try:
        refused = run_script(STAGE_SCRIPT, "--output-dir", str(out), "--verify", env=ONE_THREAD)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"pid {holder.pid} on host {socket.gethostname()}, started 20" in refused.stdout
        assert config.read_text() == config_before  # the refused run left the configuration alone
        refused = run_script("03_build_vocab_mapping.py", "--model-path", str(stories260k), "--prepared-data",
                             str(data), "--output-dir", str(out))  # every stage takes the lock
        assert refused.returncode == 2 and f"pid {holder.pid}" in refused.stdout
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f'"pid": {holder.pid}' in (out / ".lock").read_text()  # killed: its record stays behind
    taken = run_script(STAGE_SCRIPT, "--output-dir", str(out), "--verify", env=ONE_THREAD)
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert f"taking over the lock left by pid {holder.pid}" in taken.stdout and "no longer running" in taken.stdout
    assert config.read_text() == config_before  # a --verify run describes no output of its own
    assert (out / ".lock").read_text() == ""  # released cleanly


def test_run_pipeline_locks_its_run_directory(stories260k, tmp_path):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        result = subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "--run-dir", str(run),
                                 "--model-path", str(stories260k), "--only", "03"], capture_output=True, text=True,
                                cwd=str(REPO), timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2 and f"pid {holder.pid}" in result.stderr, result.stdout + result.stderr
    assert not (run / "vocab").exists()  # no stage started


def test_stage04_lock_keeps_a_resume_away_from_a_running_training(stories260k, tmp_path):
    from test_train import _load_module, build_run, train_argv

    run = build_run(stories260k, tmp_path / "run", seed=4)
    out = tmp_path / "out"
    holder = hold_lock(out)  # stands for a training that is still running in this folder
    try:
        stage04 = _load_module("stage04_train", "04_train.py")
        assert stage04.main(train_argv(run, out, stories260k, resume=True)) == 2
    finally:
        holder.kill()
        holder.wait()
    assert f"pid {holder.pid}" in (out / "logs" / "04_train.log").read_text()
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("step_*"))


# --- 4. the same verifier, not only the same shape ---------------------------------------------------------

def test_a_verifier_with_other_weights_is_refused_naming_both(stories260k, tmp_path):
    from test_train import _load_module, build_run, train_argv

    run = build_run(stories260k, tmp_path / "run", seed=5)
    other = tmp_path / "finetuned"
    shutil.copytree(stories260k, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in weights if "layers.2.mlp" in k)
    weights[name] = weights[name] * 1.01  # another fine-tune: same config, same tokenizer
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    stage04 = _load_module("stage04_train", "04_train.py")
    out = tmp_path / "out"
    assert stage04.main(train_argv(run, out, other, epochs=1)) == 2
    error = (out / "logs" / "04_train.log").read_text().split("ERROR")[-1]
    assert f"--model-path {other} has other weights" in error and str(stories260k) in error
    assert "--allow-other-verifier" in error
    assert stage04.main(train_argv(run, out, other, epochs=1, allow_other_verifier=True)) == 0
    assert "continuing: --allow-other-verifier" in (out / "logs" / "04_train.log").read_text()
    # stage 05 compares with what stage 04 carried forward
    stage05 = _load_module("stage05_bench", "05_benchmark.py")
    bench = tmp_path / "bench"
    assert stage05.main(["--mode", "eval", "--model-path", str(other), "--draft-model-path", str(out / "best"),
                         "--data-dir", str(run / "hidden_states"), "--output-dir", str(bench), "--device", "cpu"]) == 2
    assert f"--model-path {other} has other weights" in (bench / "logs" / "05_benchmark.log").read_text()


def test_tokenizer_mismatch_names_both_models():
    from eagle3_pipeline.formats.manifest import check_verifier_matches

    upstream = {"verifier": {"path": "/models/llama-a", "tokenizer_sha256": "a" * 64}}
    with pytest.raises(UsageError) as error:
        check_verifier_matches(upstream, "data/manifest.json", {"path": "/models/llama-b", "tokenizer_sha256": "b" * 64},
                               "--model-path /models/llama-b")
    assert "/models/llama-a" in str(error.value) and "/models/llama-b" in str(error.value)


# --- 5. bytes that are not UTF-8 ----------------------------------------------------------------------------

def test_invalid_utf8_in_a_json_array_is_a_bad_record_with_its_line(tmp_path):
    from eagle3_pipeline.bench.prompts import load_prompts
    from eagle3_pipeline.data.records import BadRecordError
    from eagle3_pipeline.data.sources import iter_json_array

    path = tmp_path / "chats.json"
    path.write_bytes(b'[\n{"text": "one"},\n{"text": "t\xffwo"},\n{"text": "caf\xc3\xa9"}\n]\n')
    items = list(iter_json_array(path))
    assert [line for line, _ in items] == [2, 3, 4]
    assert items[0][1] == {"text": "one"} and items[2][1] == {"text": "café"}
    bad = items[1][1]
    assert isinstance(bad, BadRecordError) and bad.reason == "invalid_utf8" and "0xff on line 3" in bad.detail
    prompts = tmp_path / "prompts.json"
    prompts.write_bytes(b'[{"prompt": "fine"}, {"prompt": "\xe9t\xe9"}]')
    with pytest.raises(UsageError, match=r"prompts.json:1: byte 0xe9 on line 1 is not UTF-8"):
        load_prompts(str(prompts))
    prompts.write_bytes(b'{"prompt": "fine"}\n{"prompt": "\xe9t\xe9"}\n')
    with pytest.raises(UsageError, match=r"prompts.json:2: byte 0xe9 at column 13 is not UTF-8"):
        load_prompts(str(prompts))


# --- 6. the overlap check covers plain-text training data ---------------------------------------------------

def test_overlap_check_covers_plain_text_training_data(stories260k, tmp_path):
    import logging

    from eagle3_pipeline.bench.lineage import check_overlap
    from eagle3_pipeline.bench.prompts import load_prompts

    texts = [f"Once upon a time there was a little dog number {i} who liked to run in the park " * 3 for i in range(6)]
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run = tmp_path / "run"
    done = run_script("01_prepare_data.py", "--run-dir", str(run), "--model-path", str(stories260k),
                      "--dataset", str(dataset), "--max-seq-len", "64")
    assert done.returncode == 0, done.stdout + done.stderr
    drafter = run / "checkpoints" / "best"  # the lineage a trained drafter leaves: best/ -> 04 -> 02 -> 01
    drafter.mkdir(parents=True)
    write_json_atomic(run / "checkpoints" / "manifest.json", {"stage": "04_train", "inputs": {
        "hidden_states": {"path": str(run / "hidden_states")}}})
    (run / "hidden_states").mkdir()
    write_json_atomic(run / "hidden_states" / "manifest.json", {"stage": "02_extract_hidden_states", "inputs": {
        "prepared_data": {"path": str(run / "data" / "tokenized_data.jsonl")}}})
    prompts = tmp_path / "prompts.jsonl"
    prompt_words = " ".join(texts[2].split()[:40])  # a completion prompt: the text's first 40 words
    prompts.write_text(json.dumps({"prompt": "Tell me about cats."}) + "\n" + json.dumps({"prompt": texts[4]})
                       + "\n" + json.dumps({"prompt": prompt_words + " and then?"}) + "\n")
    with pytest.raises(UsageError, match=r"2 of 3 benchmark prompts were training prompts"):
        check_overlap(load_prompts(str(prompts)), str(drafter), False, logging.getLogger("test"))


# --- 7. check_drafter.py fails where vLLM would read other layers ----------------------------------------------

def test_check_drafter_fails_when_vllm_would_capture_other_layers(tmp_path):
    from test_drafter import _plant, save_drafter, tiny_model

    model, _ = tiny_model(dtype=torch.float32)
    save_drafter(model, tmp_path / "d")
    (tmp_path / "hs").mkdir()
    (tmp_path / "hs" / "manifest.json").write_text(json.dumps({"aux_layers": model.config.aux_layers}))
    assert run_script("scripts/check_drafter.py", str(tmp_path / "d"), "--data-dir", str(tmp_path / "hs")).returncode == 0
    # The trap scripts/lab/device_serve_vllm.sh serves: the top-level (vLLM) ids written in SGLang's convention
    _plant(tmp_path / "d", config_fn=lambda c: c.__setitem__(
        "eagle_aux_hidden_state_layer_ids", list(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])))
    done = run_script("scripts/check_drafter.py", str(tmp_path / "d"), "--data-dir", str(tmp_path / "hs"))
    assert done.returncode == 1 and "vLLM would capture the inputs of layers" in done.stdout, done.stdout
    # SGLang's ids still right, the top-level (vLLM) ids gone: vLLM would capture other layers
    _plant(tmp_path / "d", config_fn=lambda c: (c["eagle_config"].__setitem__(
        "eagle_aux_hidden_state_layer_ids", [0, 2, 4]), c.pop("eagle_aux_hidden_state_layer_ids")))
    done = run_script("scripts/check_drafter.py", str(tmp_path / "d"), "--data-dir", str(tmp_path / "hs"))
    assert done.returncode == 1 and "problem:" in done.stdout and "vLLM would capture" in done.stdout, done.stdout
