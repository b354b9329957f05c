"""Stage 04 --online: the verifier computes each batch's states inside training, from stage 01's prepared data.

Every test sets an online run beside what the offline path makes of the same prepared data: the real stage 02
writes the hidden states, the real stage 04 trains on them, and the online run must give the same metric lines
and the same exported drafter (stories260K in float32 and bf16, FP8 aux with top-k targets, SmolLM2's real
weights). Then what stage 04 does besides training, online: resume after a crash and after SIGTERM, the
refusals (other weights, other settings, a folder in use), --finetune-from, the export's checks and stage 05.
The two-rank run is in tests/test_distributed.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.formats.files import read_json
from conftest import REPO, run_script
from test_train import (RESUME_FLAGS, _load_module, comparable, crash_at, final_weights, log_text, signal_at,
                        train_argv, write_prepared_data)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FLAGS = dict(epochs=2, eval_interval=5, save_interval=6, log_interval=1)  # 24 steps, 6 validations
FP8_TOPK = {"aux_dtype": "float8_e4m3", "targets": "topk", "target_topk": 16}


def as_flags(values: dict) -> list[str]:
    return [part for key, value in values.items() for part in (f"--{key.replace('_', '-')}", str(value))]


def prepared(run: Path) -> Path:
    return run / "data" / "tokenized_data.jsonl"


def online_argv(run: Path, out: Path, model: Path, **flags) -> list[str]:
    """train_argv with --online from the run's prepared data and no --data-dir at all."""
    return train_argv(run, out, model, online=True, prepared_data=prepared(run), data_dir=None, **flags)


def extract(stage02, run: Path, model: Path, folder: str, **flags) -> Path:
    out = run / folder
    assert stage02.main(["--run-dir", str(run), "--output-dir", str(out), "--model-path", str(model), "--device",
                         "cpu", "--num-workers", "0", *as_flags(flags)]) == 0
    return out


@pytest.fixture(scope="module")
def stage02():
    return _load_module("stage02_online", "02_extract_hidden_states.py")


@pytest.fixture(scope="module")
def stage04():
    return _load_module("stage04_online", "04_train.py")


@pytest.fixture(scope="module")
def run(stories260k, stage02, tmp_path_factory) -> Path:
    """Prepared data, the real stage 03, and the real stage 02 in float32 (the offline side of the comparisons)."""
    run = tmp_path_factory.mktemp("online_run")
    write_prepared_data(stories260k, run, seed=0)
    stage03 = _load_module("stage03_online", "03_build_vocab_mapping.py")
    assert stage03.main(["--run-dir", str(run), "--model-path", str(stories260k), "--draft-vocab-size", "256"]) == 0
    extract(stage02, run, stories260k, "hidden_states", dtype="float32")
    return run


@pytest.fixture(scope="module")
def pair(run, stories260k, stage04, tmp_path_factory) -> tuple[Path, Path]:
    """(offline, online) float32 runs of the same recipe."""
    folder = tmp_path_factory.mktemp("pair")
    offline, online = folder / "offline", folder / "online"
    assert stage04.main(train_argv(run, offline, stories260k, dtype="float32", **FLAGS)) == 0
    assert stage04.main(online_argv(run, online, stories260k, dtype="float32", **FLAGS)) == 0
    return offline, online


def assert_same_training(online: Path, offline: Path, loss_tol: float = 1e-5, weight_tol: float = 1e-5) -> None:
    """Every metric line of the two runs alike (the losses within loss_tol) and the same exported drafter."""
    ours, theirs = comparable(online), comparable(offline)
    assert [(r["kind"], r["step"]) for r in ours] == [(r["kind"], r["step"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= loss_tol, (a, b)
        assert a["acc_per_step"] == pytest.approx(b["acc_per_step"], abs=1e-5), (a, b)
        assert a.get("count_per_step") == b.get("count_per_step") and a.get("tokens") == b.get("tokens")
    expected, got = final_weights(offline), final_weights(online)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=weight_tol, atol=weight_tol,
                                   msg=lambda text: f"{name}: {text}")
    assert read_json(online / "latest" / "config.json") == read_json(offline / "latest" / "config.json")
    assert read_json(online / "best.json")["checkpoint"] == read_json(offline / "best.json")["checkpoint"]


@pytest.mark.slow
def test_online_training_is_offline_training_step_for_step(pair, run, stories260k):
    from eagle3_pipeline.bench.lineage import training_lineage
    from eagle3_pipeline.model.checkpoint import check_drafter_dir
    from eagle3_pipeline.formats.hidden_states import open_hidden_states

    offline, online = pair
    assert_same_training(online, offline)
    assert len([r for r in comparable(online) if r["kind"] == "eval"]) == 6  # validation ran online too

    # The manifest says where the states came from, in place of stage 02's manifest.
    data_manifest, _ = open_hidden_states(run / "hidden_states")
    manifest = read_json(online / "manifest.json")
    assert manifest["status"] == "complete" and "hidden_states" not in manifest["inputs"]
    assert manifest["inputs"]["prepared_data"]["manifest_sha256"] == data_manifest["inputs"]["prepared_data"][
        "manifest_sha256"]
    states = manifest["states"]
    assert states["source"] == "online" and states["aux_layers"] == data_manifest["aux_layers"]
    assert states["verifier_weights"] == data_manifest["verifier_weights"] == manifest["verifier_weights"]
    assert (states["dtype"], states["storage"], states["layer_convention"]) == \
        (data_manifest["dtype"], data_manifest["storage"], data_manifest["layer_convention"])
    assert "--online: loading the verifier" in log_text(online)
    # Nothing written but what an offline run writes (no states on disk).
    assert sorted(p.name for p in online.iterdir()) == sorted(p.name for p in offline.iterdir())
    # The export passes the checks an offline drafter passes, and stage 05 traces it to its training prompts.
    assert check_drafter_dir(online / "best", data_manifest=data_manifest) == []
    checked = run_script("scripts/check_drafter.py", str(online / "best"), "--model-path", str(stories260k))
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    _, visited = training_lineage(online / "best")
    assert str((run / "data" / "manifest.json").resolve()) in visited


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_topk"])
def test_every_storage_format_trains_online_as_from_its_files(fmt, run, stories260k, stage02, stage04, tmp_path):
    """bf16 aux and final (the default), and FP8 aux with top-k targets: the online run rounds the states as stage
    02 stores them, so it trains as the offline run on that format's files. (The verifier's float32 forward sees
    other batches online, which can move a value across a bf16 or FP8 rounding edge: one ulp of one element, so the
    losses agree to 1e-4 here rather than float32's 1e-5, and a weight to 1e-3 after 24 steps.)"""
    flags = {} if fmt == "bfloat16" else FP8_TOPK
    data = extract(stage02, run, stories260k, f"states_{fmt}", **flags)
    offline, online = tmp_path / "offline", tmp_path / "online"
    assert stage04.main(train_argv(run, offline, stories260k, data_dir=data, **FLAGS, **flags)) == 0
    assert stage04.main(online_argv(run, online, stories260k, **FLAGS, **flags)) == 0
    assert_same_training(online, offline, loss_tol=1e-4, weight_tol=1e-3)
    assert read_json(online / "manifest.json")["states"]["storage"] == read_json(data / "manifest.json")["storage"]
    # A format the data does not hold is refused offline, naming the way out.
    refused = tmp_path / "refused"
    other = FP8_TOPK if fmt == "bfloat16" else {"aux_layers": "1,2,4"}
    assert stage04.main(train_argv(run, refused, stories260k, data_dir=data, **FLAGS, **other)) == 2
    assert "pass --online to compute the states in training" in log_text(refused)


@pytest.mark.slow
def test_online_resume_after_a_crash_and_after_sigterm_ends_as_an_uninterrupted_run(run, stories260k, stage04,
                                                                                    tmp_path):
    """RESUME_FLAGS of the offline resume test (noise on the states, so the RNG matters; two micro-batches a
    step): a crash after step 10 and a SIGTERM after step 7, each resumed, end bit for bit where the whole run
    ends."""
    import signal

    whole, crashed, stopped = tmp_path / "whole", tmp_path / "crashed", tmp_path / "stopped"
    assert stage04.main(online_argv(run, whole, stories260k, **RESUME_FLAGS)) == 0
    assert stage04.main(online_argv(run, crashed, stories260k, **RESUME_FLAGS), hooks=[crash_at(10)]) == 1
    assert read_json(crashed / "latest.json")["checkpoint"] == "step_000008"
    assert stage04.main(online_argv(run, crashed, stories260k, resume=True, **{**RESUME_FLAGS, "num_workers": 1})) == 0
    assert "step 8, epoch 2" in log_text(crashed)
    assert stage04.main(online_argv(run, stopped, stories260k, **RESUME_FLAGS),
                        hooks=[signal_at(7, signal.SIGTERM)]) == 130
    assert read_json(stopped / "latest.json")["checkpoint"] == "step_000007"
    assert stage04.main(online_argv(run, stopped, stories260k, resume=True, **RESUME_FLAGS)) == 0
    assert comparable(crashed) == comparable(whole)
    # (the stopped run also wrote the metrics of the steps since its last line, at the stop)
    assert [r for r in comparable(stopped) if r["kind"] == "eval"] == [r for r in comparable(whole) if r["kind"] == "eval"]
    expected = final_weights(whole)
    for resumed in (crashed, stopped):
        got = final_weights(resumed)
        for name in expected:
            assert torch.equal(got[name], expected[name]), (resumed.name, name)


@pytest.mark.slow
def test_online_refusals_name_the_cause(pair, run, stories260k, stage04, tmp_path):
    from eagle3_pipeline.cli.lock import OutputLock

    _, online = pair
    flags = dict(dtype="float32", **FLAGS)
    # A resume whose verifier has other weights (same config and tokenizer): the states would differ.
    other = tmp_path / "other_verifier"
    shutil.copytree(stories260k, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] += 0.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    copy = tmp_path / "copy"
    shutil.copytree(online, copy, symlinks=True)
    assert stage04.main(online_argv(run, copy, other, resume=True, **flags)) == 2
    assert "online_states.verifier_weights" in log_text(copy)
    # The same run resumed offline, or online with other aux layers, is another run.
    assert stage04.main(train_argv(run, copy, stories260k, resume=True, **flags)) == 2
    assert "online_states" in log_text(copy).split("--resume from")[-1]
    assert stage04.main(online_argv(run, copy, stories260k, resume=True, aux_layers="1,2,4", **flags)) == 2
    assert "online_states.aux_layers: was [1, 2, 3], now [1, 2, 4]" in log_text(copy)
    # Inputs checked before the verifier loads.
    fresh = tmp_path / "fresh"
    assert stage04.main(online_argv(run, fresh, stories260k, aux_layers="1,2,9", **flags)) == 2
    assert "outside 0..4" in log_text(fresh)
    assert stage04.main(train_argv(run, fresh, stories260k, online=True, data_dir=None, **flags)) == 2
    assert "give --prepared-data" in log_text(fresh)
    # One writer per folder, online too.
    lock = OutputLock(fresh).acquire()
    try:
        assert stage04.main(online_argv(run, fresh, stories260k, **flags)) == 2
    finally:
        lock.release()
    assert "is in use" in log_text(fresh)


@pytest.mark.slow
def test_finetune_from_online_and_stage05_on_the_online_drafter(pair, run, stories260k, stage04, tmp_path):
    from test_benchmark import bench_prompts

    offline, online = pair
    tuned = tmp_path / "tuned"
    assert stage04.main(online_argv(run, tuned, stories260k, finetune_from=offline / "best", epochs=1,
                                    eval_interval=100, save_interval=100)) == 0
    assert read_json(tuned / "manifest.json")["inputs"]["finetune_from"]["path"] == str((offline / "best").resolve())
    stage05 = _load_module("stage05_online", "05_benchmark.py")
    bench = tmp_path / "bench"
    assert stage05.main(["--mode", "offline", "--model-path", str(stories260k), "--draft-model-path",
                         str(online / "best"), "--prompts", str(bench_prompts(tmp_path)), "--max-new-tokens", "16",
                         "--device", "cpu", "--dtype", "float32", "--output-dir", str(bench), "--tau-only"]) == 0
    report = json.loads((bench / "bench_offline_k3_t0_tau_prompts.json").read_text())
    assert report["overall"]["tau"] >= 1.0 and report["overall"]["greedy_match"]["turns_identical"] == \
        report["overall"]["turns"]


def sharegpt_conversations(path: Path, count: int) -> list[dict]:
    from eagle3_pipeline.data.sources import iter_json_array

    conversations = []
    for _, record in iter_json_array(path):
        turns = record.get("conversations") or []
        if len(turns) >= 2 and [turn.get("from") for turn in turns[:2]] == ["human", "gpt"] and \
                all(turn.get("value") for turn in turns[:2]):
            conversations.append({"id": str(record.get("id", len(conversations))), "conversations": turns[:2]})
        if len(conversations) == count:
            return conversations
    return conversations


@pytest.mark.slow
def test_smollm2_online_trains_as_offline(smollm2, sharegpt_path, stage02, stage04, tmp_path):
    """SmolLM2-135M-Instruct's real weights and chat template, 24 ShareGPT conversations through the real stages
    01-03, then stage 02 + stage 04 against stage 04 --online (float32, a few steps)."""
    run = tmp_path / "run"
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(sharegpt_conversations(sharegpt_path, 24)))
    stage01 = _load_module("stage01_online", "01_prepare_data.py")
    assert stage01.main(["--run-dir", str(run), "--model-path", str(smollm2), "--dataset", str(dataset),
                         "--max-seq-len", "160", "--max-bad-fraction", "0.5"]) == 0
    stage03 = _load_module("stage03_online_smol", "03_build_vocab_mapping.py")
    assert stage03.main(["--run-dir", str(run), "--model-path", str(smollm2), "--draft-vocab-size", "2048"]) == 0
    extract(stage02, run, smollm2, "hidden_states", dtype="float32", max_seq_len=160)
    flags = dict(dtype="float32", epochs=1, eval_interval=3, save_interval=100, log_interval=1, max_seq_len=160,
                 max_tokens_per_batch=640, ttt_steps=2, val_ratio=0.2)
    offline, online = tmp_path / "offline", tmp_path / "online"
    assert stage04.main(train_argv(run, offline, smollm2, **flags)) == 0
    assert stage04.main(online_argv(run, online, smollm2, **flags)) == 0
    assert len(comparable(online)) >= 4
    assert_same_training(online, offline)


@pytest.mark.slow
def test_bench_scaling_times_online_against_offline_on_the_same_batches(tmp_path):
    """scripts/lab/bench_scaling.py --online (the GPU benchmark of the online source), run small on the CPU: both
    stage 04 runs train the same batches to the same loss, and the ratio is reported per process count."""
    done = run_script("scripts/lab/bench_scaling.py", "--device", "cpu", "--random-llama", "tiny",
                      "--num-samples", "24", "--min-len", "32", "--max-len", "96", "--max-tokens-per-batch", "512",
                      "--gpus", "1", "--online",
                      "--ttt-steps", "2", "--draft-vocab-size", "256", "--work-dir", str(tmp_path / "work"),
                      env={"OUT": str(tmp_path / "out")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = read_json(tmp_path / "out" / "bench_scaling.json")
    runs = result["stage04"]["runs"]
    assert [r["source"] for r in runs] == ["offline", "online"]
    assert runs[0]["timed_tokens"] == runs[1]["timed_tokens"] > 0 and runs[0]["final_loss"] == runs[1]["final_loss"]
    compared = result["stage04"]["online_against_offline"]["1"]
    assert compared["same_final_loss"] and compared["tokens_per_s_ratio"] > 0
