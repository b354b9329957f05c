"""Stage 04 (training) on real hidden states of stories260K, on CPU.

The run directory is built as the pipeline builds it: prepared data (stage 01's format, here plain
stories the verifier itself sampled, since stories260K has no chat template), the real stage 03 for the
vocabulary map (--draft-vocab-size 256 of 512, so d2t is not the identity), and the real stage 02 for the
hidden states. The verifier handed to stage 04 is a Kimi-K2.5-shaped copy of stories260K: nested
text_config, sharded safetensors with nested tensor names, and a shard of decoder layers that is not even
a safetensors file, so any attempt to read more than embed_tokens and lm_head fails.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.formats.manifest import MANIFEST, Manifest
from eagle3_pipeline.formats.files import read_json, write_json_atomic
from eagle3_pipeline.verifier.loading import read_verifier_info
from conftest import REPO, run_script

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

NUM_SAMPLES = 72
DRAFT_VOCAB = 256
TTT = 3
EPOCHS = 6  # about 12 optimizer steps each


# --- building the run directory ------------------------------------------------------------------------

def _load_module(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, REPO / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in the script look their module up there
    spec.loader.exec_module(module)
    return module


def write_prepared_data(stories260k: Path, run_dir: Path, seed: int, count: int = NUM_SAMPLES) -> Path:
    """Stage 01's output for plain text: stories sampled from the verifier, loss on all but the BOS token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.full((count, 1), 1), do_sample=True, temperature=1.0, max_new_tokens=95,
                             min_new_tokens=95, pad_token_id=0)
    lengths = torch.randint(32, out.shape[1] + 1, (count,), generator=generator).tolist()
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True)
    info = read_verifier_info(str(stories260k))
    manifest = Manifest(data_dir, "01_prepare_data", {"seed": seed})
    manifest.data["verifier"] = info.identity()
    tokens = 0
    with open(data_dir / "tokenized_data.jsonl", "w") as handle:
        for i, (row, length) in enumerate(zip(out.tolist(), lengths)):
            ids = row[:length]
            handle.write(json.dumps({"id": f"s{seed}-{i:03d}", "input_ids": ids,
                                     "loss_mask": [0] + [1] * (len(ids) - 1)}) + "\n")
            tokens += len(ids)
    manifest.data["counts"] = {"samples": count, "tokens": tokens, "loss_tokens": tokens - count}
    manifest.complete()
    return data_dir / "tokenized_data.jsonl"


def build_run(stories260k: Path, run_dir: Path, seed: int) -> Path:
    """Prepared data, then the real stages 03 and 02 (in this process: a subprocess spends more time
    importing torch and transformers than these stages spend working)."""
    write_prepared_data(stories260k, run_dir, seed)
    stage03 = _load_module("stage03_vocab", "03_build_vocab_mapping.py")
    assert stage03.main(["--run-dir", str(run_dir), "--model-path", str(stories260k),
                         "--draft-vocab-size", str(DRAFT_VOCAB)]) == 0
    stage02 = _load_module("stage02_extract", "02_extract_hidden_states.py")
    assert stage02.main(["--run-dir", str(run_dir), "--model-path", str(stories260k), "--device", "cpu",
                         "--num-workers", "0"]) == 0
    return run_dir


def make_nested_sharded_verifier(stories260k: Path, target: Path) -> Path:
    """stories260K dressed as Kimi-K2.5: nested config, three shards, nested names, a corrupt layer shard."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target.mkdir(parents=True)
    text_config = read_json(stories260k / "config.json")
    text_config["tie_word_embeddings"] = False
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text_config, "vision_config": {"hidden_size": 32}, "tie_word_embeddings": False}
    write_json_atomic(target / "config.json", config)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(stories260k / name, target / name)
    with safe_open(str(stories260k / "model.safetensors"), framework="pt") as handle:
        weights = {name: handle.get_tensor(name) for name in handle.keys()}
    embed = weights.pop("model.embed_tokens.weight")
    # Shard 1: the embedding, plus a vision tower's embedding that must not be picked.
    save_file({"language_model.model.embed_tokens.weight": embed,
               "vision_tower.embed_tokens.weight": torch.zeros(8, 32)}, str(target / "model-00001-of-00003.safetensors"))
    # Shard 2: the decoder layers, as garbage bytes: opening this file at all raises.
    (target / "model-00002-of-00003.safetensors").write_bytes(os.urandom(4096))
    # Shard 3: lm_head (stories260K ties it to the embedding; stored here as its own tensor) and the norm.
    head = embed.clone()
    save_file({"language_model.lm_head.weight": head, "language_model.model.norm.weight": weights["model.norm.weight"]},
              str(target / "model-00003-of-00003.safetensors"))
    weight_map = {"language_model.model.embed_tokens.weight": "model-00001-of-00003.safetensors",
                  "vision_tower.embed_tokens.weight": "model-00001-of-00003.safetensors",
                  "language_model.lm_head.weight": "model-00003-of-00003.safetensors",
                  "language_model.model.norm.weight": "model-00003-of-00003.safetensors"}
    for name in weights:
        if name != "model.norm.weight":
            weight_map["language_model." + name] = "model-00002-of-00003.safetensors"
    write_json_atomic(target / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    return target


@pytest.fixture(scope="module")
def run_a(stories260k, tmp_path_factory) -> Path:
    return build_run(stories260k, tmp_path_factory.mktemp("run_a"), seed=0)


@pytest.fixture(scope="module")
def nested_verifier(stories260k, tmp_path_factory) -> Path:
    return make_nested_sharded_verifier(stories260k, tmp_path_factory.mktemp("kimi_like") / "model")


@pytest.fixture(scope="module")
def stage04():
    return _load_module("stage04_train", "04_train.py")


# --- batching, split, schedule, pointers (no model needed) ----------------------------------------------

def test_batch_plan_packs_by_length_under_the_token_budget_and_is_seeded():
    from eagle3_pipeline.train.data import plan_batches

    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 200, (500,), generator=generator).tolist()
    plan = plan_batches(lengths, max_tokens=1000, max_sequences=16, seed=7, epoch=0)
    flat = sorted(i for batch in plan for i in batch)
    assert flat == list(range(500))  # every sample exactly once
    for batch in plan:
        assert len(batch) <= 16 and len(batch) * max(lengths[i] for i in batch) <= 1000
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plan)
    assert padded < 1.15 * sum(lengths)  # bucketing keeps padding small
    assert plan == plan_batches(lengths, 1000, 16, seed=7, epoch=0)
    assert plan != plan_batches(lengths, 1000, 16, seed=7, epoch=1)
    assert plan != plan_batches(lengths, 1000, 16, seed=8, epoch=0)


def test_validation_split_is_by_sample_seeded_and_independent_of_index_order():
    from eagle3_pipeline.train.data import split_train_val

    ids = [f"id{i}" for i in range(200)]
    train, val = split_train_val(ids, 0.1, seed=0)
    assert len(val) == 20 and sorted(train + val) == list(range(200))
    reordered = list(reversed(ids))
    _, val_reordered = split_train_val(reordered, 0.1, seed=0)
    assert {ids[i] for i in val} == {reordered[i] for i in val_reordered}
    assert set(split_train_val(ids, 0.1, seed=1)[1]) != set(val)
    assert split_train_val(ids, 0.0, seed=0)[1] == []


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_scheduler_warms_up_then_decays(kind):
    from eagle3_pipeline.train.optimizer import make_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    scheduler = make_scheduler(optimizer, total_steps=100, warmup_ratio=0.1, kind=kind)
    rates = []
    for _ in range(100):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a <= b + 1e-12 for a, b in zip(rates[:10], rates[1:10]))
    if kind == "constant":
        assert rates[-1] == pytest.approx(1.0)
    else:
        assert rates[-1] < 0.05 and all(a >= b - 1e-12 for a, b in zip(rates[10:], rates[11:]))


def _fake_checkpoint(root: Path, name: str, step: int) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "config.json").write_text("{}")
    (root / name / "training_state.pt").write_bytes(b"x")
    write_json_atomic(root / name / "trainer_state.json", {"step": step})


@pytest.mark.parametrize("symlinks", [True, False])
def test_pointers_and_pruning(tmp_path, monkeypatch, symlinks):
    from eagle3_pipeline.train.checkpoints import CheckpointManager

    if not symlinks:  # a filesystem without symlinks (fault injected: os.symlink raises as it would there)
        def no_symlink(*args, **kwargs):
            raise OSError("symlinks not supported here")
        monkeypatch.setattr(os, "symlink", no_symlink)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        _fake_checkpoint(tmp_path, f"step_{step:06d}", step)
        manager.point("latest", f"step_{step:06d}", {"step": step})
        if step == 10:
            manager.point("best", "step_000010", {"step": step})
    assert manager.prune() == ["step_000020"]  # step 10 is best, 30 and 40 the newest two
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000010", "step_000030", "step_000040"]
    for pointer, target in (("latest", "step_000040"), ("best", "step_000010")):
        link = tmp_path / pointer
        assert link.is_dir() and (link / "config.json").exists()
        assert link.is_symlink() == symlinks
        assert not (link / "training_state.pt").exists() or symlinks  # copies carry the drafter only
        assert read_json(tmp_path / f"{pointer}.json")["checkpoint"] == target
    assert manager.complete_checkpoints()[-1][1].name == "step_000040"  # (resume_point checks the files: none here)


# --- stage 04 end to end ---------------------------------------------------------------------------------

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def train_argv(run: Path, out: Path, model_path: Path, **flags) -> list[str]:
    """Flags of a small, fast run; no --run-dir, so the log is OUT/logs/04_train.log. --min-steps 0: the tests plan
    their own steps (the default's cap has its own test); min_steps=None leaves the default."""
    values = {"--data-dir": run / "hidden_states", "--vocab-mapping-dir": run / "vocab", "--output-dir": out,
              "--model-path": model_path, "--ttt-steps": TTT, "--max-tokens-per-batch": 384, "--batch-size": 8,
              "--lr": 5e-3, "--warmup-ratio": 0.05, "--val-ratio": 0.15, "--num-workers": 0, "--device": "cpu",
              "--seed": 0, "--min-steps": 0}
    values.update({f"--{k.replace('_', '-')}": v for k, v in flags.items()})
    argv = []
    for name, value in values.items():
        if value is True:
            argv.append(name)
        elif value is not None and value is not False:
            argv += [name, str(value)]
    return argv


def records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def log_text(out: Path) -> str:
    return (out / "logs" / "04_train.log").read_text()


@pytest.fixture(scope="module")
def trained(run_a, nested_verifier, tmp_path_factory) -> Path:
    """A full run as a user starts it, against the Kimi-shaped verifier whose layer shard is garbage."""
    out = tmp_path_factory.mktemp("trained") / "checkpoints"
    done = run_script("04_train.py", *train_argv(run_a, out, nested_verifier, epochs=EPOCHS, eval_interval=30,
                                                 save_interval=25, keep_last=1, log_interval=10, num_workers=2),
                      env=ONE_THREAD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_training_learns_and_writes_sglang_ready_checkpoints(trained, run_a, nested_verifier):
    from eagle3_pipeline.model.checkpoint import check_drafter_dir
    from eagle3_pipeline.formats.hidden_states import open_hidden_states

    train, evals = records(trained, "train"), records(trained, "eval")
    # The loss falls and the agreement with the verifier rises, at every TTT step, on held-out samples.
    assert train[-1]["loss"] < 0.75 * train[0]["loss"]
    assert len(evals) >= EPOCHS and evals[-1]["loss"] < evals[0]["loss"]
    for j in range(TTT):
        assert evals[-1]["acc_per_step"][j] > evals[0]["acc_per_step"][j] + 0.1, [e["acc_per_step"] for e in evals]
    assert evals[-1]["sim_accept_len"] > evals[0]["sim_accept_len"] + 0.2
    # chain decoding with 3 drafts walked over the predictions: it rises too, and stays within 1..4 tokens a step
    assert evals[-1]["sim_chain_tau"] > evals[0]["sim_chain_tau"] + 0.1 and 1.0 <= evals[0]["sim_chain_tau"] <= 4.0
    assert all(e["count_per_step"][0] > 300 for e in evals)  # measured on real tokens
    # the share of wall time spent waiting for the DataLoader, to tell a data-bound run from a compute-bound one
    assert all(0.0 <= r["data_wait_share"] <= 1.0 for r in train) and "waiting for data" in log_text(trained)

    # Checkpoints: one per epoch, step ones pruned to --keep-last (except a pointer target), pointers resolve.
    assert sorted(p.name for p in trained.glob("epoch_*")) == [f"epoch_{e}" for e in range(1, EPOCHS + 1)]
    best, latest = read_json(trained / "best.json"), read_json(trained / "latest.json")
    steps = sorted(p.name for p in trained.glob("step_*"))
    assert len([s for s in steps if s != best["checkpoint"]]) <= 1
    last = f"epoch_{EPOCHS}"
    assert latest["checkpoint"] == last and (trained / "latest").resolve().name == last
    assert (trained / "best").is_dir() and (trained / "best").resolve().name == best["checkpoint"]
    # best = the highest validation simulated acceptance length among the saved (= kept) checkpoints
    saved_steps = {read_json(p / "trainer_state.json")["step"] for p in [*trained.glob("epoch_*"), *trained.glob("step_*")]}
    assert best["val_sim_accept_len"] == max(e["sim_accept_len"] for e in evals if e["step"] in saved_steps)
    assert best["metric"] == "val_sim_accept_len"
    data_manifest, _ = open_hidden_states(run_a / "hidden_states")
    info = read_verifier_info(str(nested_verifier))
    for folder in [*trained.glob("epoch_*"), *trained.glob("step_*"), trained / "best"]:
        assert check_drafter_dir(folder, data_manifest=data_manifest, verifier_info=info) == [], folder
    state = torch.load(trained / last / "training_state.pt", weights_only=True)
    assert {"optimizer", "scheduler", "rng", "loop_state"} <= state.keys()
    assert state["loop_state"]["epoch"] == EPOCHS and state["loop_state"]["batches_consumed"] == 0
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)

    manifest = read_json(trained / MANIFEST)
    assert manifest["status"] == "complete" and manifest["best"] == best["checkpoint"]
    assert manifest["inputs"]["hidden_states"]["manifest_sha256"]
    assert "the verifier itself is not loaded" in log_text(trained)
    # The curves from metrics.jsonl (no TensorBoard needed), and every file readable as a plain open() makes
    # it (safetensors' save_file alone makes 0600, which a group sharing the run cannot read).
    assert (trained / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "training curves (loss, acceptance by step)" in log_text(trained)
    umask = os.umask(0)
    os.umask(umask)
    for file in [*(trained / last).iterdir(), trained / "training_curves.png", run_a / "vocab" / "vocab_mapping.safetensors"]:
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file


@pytest.mark.slow
def test_fp8_training_learns_like_bf16_and_exports_the_same_format(trained, run_a, stories260k, tmp_path):
    """Stage 04 --fp8 on the same data (CPU FP8 GEMMs; the intermediate size made a multiple of 16 so every
    GEMM runs in FP8): the validation agreement rises as in the full-precision run and checkpoints pass."""
    from eagle3_pipeline.model.checkpoint import check_drafter_dir
    from eagle3_pipeline.formats.hidden_states import open_hidden_states

    out = tmp_path / "fp8"
    # Half the full run's epochs: torch's CPU FP8 GEMM is a slow reference kernel (0.3 s for 512 x 64 x 176), and
    # six epochs took 570 s of the subprocess's 600.
    epochs = EPOCHS // 2
    done = run_script("04_train.py", *train_argv(run_a, out, stories260k, epochs=epochs, eval_interval=1000,
                                                 save_interval=1000, keep_last=1, fp8=True,
                                                 drafter_config='{"intermediate_size": 176}'), env=ONE_THREAD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--fp8: the drafter's GEMMs run on FP8 tensor cores" in log_text(out)
    fp8_evals, full_evals = records(out, "eval"), records(trained, "eval")
    assert len(fp8_evals) >= epochs
    assert fp8_evals[-1]["sim_accept_len"] > fp8_evals[0]["sim_accept_len"] + 0.1
    # as good as full precision after as many steps, within what a different intermediate size and FP8 rounding
    # can explain
    full_then = min(full_evals, key=lambda r: abs(r["step"] - fp8_evals[-1]["step"]))
    assert fp8_evals[-1]["sim_accept_len"] > full_then["sim_accept_len"] - 0.15, (fp8_evals[-1], full_then)
    data_manifest, _ = open_hidden_states(run_a / "hidden_states")
    assert check_drafter_dir(out / "best", data_manifest=data_manifest) == []


def test_embedding_and_lm_head_are_the_only_tensors_read(nested_verifier, stories260k, monkeypatch):
    """A spy (not a mock: the real safe_open reads the real files) records every shard opened and tensor read."""
    import safetensors

    from eagle3_pipeline.verifier.loading import read_embedding_tensors

    opened, read = [], []
    real_safe_open = safetensors.safe_open

    class SpyHandle:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

    def spy_safe_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return SpyHandle(real_safe_open(path, *args, **kwargs))

    monkeypatch.setattr(safetensors, "safe_open", spy_safe_open)
    tensors = read_embedding_tensors(str(nested_verifier))
    assert sorted(read) == ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight"]
    assert set(opened) == {"model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"}
    with real_safe_open(str(stories260k / "model.safetensors"), framework="pt") as handle:
        embed = handle.get_tensor("model.embed_tokens.weight")
    assert torch.equal(tensors["embed_tokens"], embed) and torch.equal(tensors["lm_head"], embed)
    info = read_verifier_info(str(nested_verifier))
    assert (info.hidden_size, info.vocab_size, info.num_layers) == (64, 512, 5) and info.nested_text_config


def test_drafter_config_sets_the_shape_of_the_trained_and_exported_drafter(run_a, stories260k, stage04, tmp_path):
    """--drafter-config overrides a field of the shape derived from the verifier: the drafter trains with it,
    config.json and the safetensors carry it, a --resume with another value is refused, and so is a
    --finetune-from drafter of another shape."""
    from safetensors import safe_open

    out = tmp_path / "out"
    flags = dict(epochs=1, eval_interval=1000, save_interval=1000, drafter_config='{"intermediate_size": 176}')
    assert stage04.main(train_argv(run_a, out, stories260k, **flags)) == 0
    with safe_open(str(out / "best" / "model.safetensors"), framework="pt") as handle:
        assert handle.get_slice("midlayer.mlp.gate_proj.weight").get_shape()[0] == 176
    assert read_json(out / "best" / "config.json")["intermediate_size"] == 176
    assert read_json(out / "best" / "trainer_state.json")["run_config"]["drafter_config"] == {"intermediate_size": 176}

    assert stage04.main(train_argv(run_a, out, stories260k, resume=True,
                                   **{**flags, "drafter_config": '{"intermediate_size": 192}'})) == 2
    assert "drafter_config.intermediate_size: was 176, now 192" in log_text(out)
    other = tmp_path / "other"
    _refused(stage04, train_argv(run_a, other, stories260k, finetune_from=out / "best", epochs=1,
                                 drafter_config='{"intermediate_size": 192}'), other,
             "--drafter-config", "intermediate_size", "192", "176")
    _refused(stage04, train_argv(run_a, other, stories260k, drafter_config='{"no_such_field": 1}'), other,
             "--drafter-config", "no_such_field")


# --- resume ----------------------------------------------------------------------------------------------

class Crash(RuntimeError):
    """Raised from a step hook: the run stops there as a killed process would (no cleanup, no final save)."""


def crash_at(step: int):
    def hook(trainer):
        if trainer.state.step == step:
            raise Crash(f"simulated crash after step {step}")
    return hook


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "latest" / "model.safetensors"))


def comparable(out: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    drop = {"tokens_per_s", "seconds", "data_wait_share"}
    return [{k: v for k, v in r.items() if k not in drop} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


# Two epochs of about six steps, two micro-batches a step, noise on the hidden states (so the RNG matters),
# a checkpoint every 4 steps: the crash at step 10 falls two steps after a mid-epoch checkpoint.
RESUME_FLAGS = dict(epochs=2, grad_accum=2, noise_std=0.05, save_interval=4, eval_interval=3, keep_last=1,
                    log_interval=3, ttt_steps=2)
CRASH_STEP = 10


@pytest.mark.slow
def test_resume_continues_exactly_like_an_uninterrupted_run(run_a, stories260k, stage04, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert stage04.main(train_argv(run_a, whole, stories260k, **RESUME_FLAGS)) == 0
    total = read_json(whole / "latest.json")["total_steps"]
    assert total == 12, "the test's premise: two epochs of six optimizer steps"

    assert stage04.main(train_argv(run_a, broken, stories260k, **RESUME_FLAGS), hooks=[crash_at(CRASH_STEP)]) == 1
    latest = read_json(broken / "latest.json")
    assert latest["checkpoint"] == "step_000008" and latest["batches_consumed"] > 0  # mid-epoch, 2 steps before
    assert max(r["step"] for r in comparable(broken)) > 8  # lines after the checkpoint, for resume to drop

    # Without --resume the folder is refused; with it (and data-loader workers this time) the run continues.
    assert stage04.main(train_argv(run_a, broken, stories260k, **RESUME_FLAGS)) == 2
    assert "--resume" in log_text(broken).splitlines()[-1]
    assert stage04.main(train_argv(run_a, broken, stories260k, resume=True,
                                   **{**RESUME_FLAGS, "num_workers": 1})) == 0
    assert "resumed from" in log_text(broken) and "step 8, epoch 2" in log_text(broken)

    ours, theirs = comparable(broken), comparable(whole)
    assert [(r["kind"], r["step"]) for r in ours] == [(r["kind"], r["step"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
        assert a["acc_per_step"] == pytest.approx(b["acc_per_step"], abs=1e-6)
    expected = final_weights(whole)
    got = final_weights(broken)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
    assert read_json(broken / "best.json")["checkpoint"] == read_json(whole / "best.json")["checkpoint"]


def signal_at(step: int, signum: int):
    """A hook that sends this process `signum` after optimizer step `step`, as `kill` would."""
    import signal

    def hook(trainer):
        if trainer.state.step == step:
            signal.raise_signal(signum)
    return hook


@pytest.mark.slow
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_continues_exactly(run_a, stories260k, stage04,
                                                                                     tmp_path):
    """SIGTERM (a scheduler's preemption, `kill`) mid-epoch, between two --save-interval checkpoints: the step
    in progress is saved, the stage exits with 130, and --resume ends where an uninterrupted run ends."""
    import signal

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert stage04.main(train_argv(run_a, whole, stories260k, **RESUME_FLAGS)) == 0
    stop_step = 7  # neither a save-interval step (4, 8) nor an epoch's end (6, 12)
    assert stage04.main(train_argv(run_a, stopped, stories260k, **RESUME_FLAGS),
                        hooks=[signal_at(stop_step, signal.SIGTERM)]) == 130
    latest = read_json(stopped / "latest.json")
    assert latest["checkpoint"] == f"step_{stop_step:06d}" and latest["step"] == stop_step
    assert max(r["step"] for r in records(stopped, "train")) == stop_step  # nothing trained after the signal
    assert f"stopped after step {stop_step} of 12" in log_text(stopped)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the stage gave the signal back

    assert stage04.main(train_argv(run_a, stopped, stories260k, resume=True, **RESUME_FLAGS)) == 0
    expected, got = final_weights(whole), final_weights(stopped)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
    ours, theirs = records(stopped, "eval"), records(whole, "eval")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)


@pytest.mark.slow
def test_weights_only_resume_would_be_caught(run_a, stories260k, stage04, tmp_path, monkeypatch):
    """Negative control for the test above: resuming only the weights (SpecForge #496) gives other results."""
    from eagle3_pipeline.train import checkpoints, trainer

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert stage04.main(train_argv(run_a, whole, stories260k, **RESUME_FLAGS)) == 0
    assert stage04.main(train_argv(run_a, broken, stories260k, **RESUME_FLAGS), hooks=[crash_at(CRASH_STEP)]) == 1

    def weights_only(self, folder):
        checkpoints.load_weights_exactly(self.model, folder)
    monkeypatch.setattr(trainer.Trainer, "load_training_state", weights_only)
    assert stage04.main(train_argv(run_a, broken, stories260k, resume=True, **RESUME_FLAGS)) == 0
    expected, got = final_weights(whole), final_weights(broken)
    assert any(not torch.allclose(got[n], expected[n], rtol=1e-4, atol=1e-5) for n in expected if n != "t2d")


# --- refusals before any heavy work ----------------------------------------------------------------------

def _refused(stage04, argv, out: Path, *needles: str) -> str:
    assert stage04.main(argv) == 2
    text = log_text(out)
    last_error = text[text.rfind("ERROR"):]
    for needle in needles:
        assert needle in last_error, (needle, last_error)
    assert not list(out.glob("step_*")) and not list(out.glob("epoch_*"))
    return last_error


def test_a_batch_bound_below_the_longest_padded_sample_is_refused(run_a, stories260k, stage04, tmp_path):
    """--max-tokens-per-batch must hold the longest sample as it is padded: the error names the flags to change."""
    longest = max(int(json.loads(line)["num_tokens"])
                  for line in (run_a / "hidden_states" / "index.jsonl").read_text().splitlines())
    out = tmp_path / "out"
    _refused(stage04, train_argv(run_a, out, stories260k, max_tokens_per_batch=longest - 1), out,
             f"--max-tokens-per-batch {longest - 1} is below the longest sample ({longest} tokens",
             "raise it, or lower --max-seq-len")
    pad = longest + 1  # the longest sample padded to one token more than the bound holds
    error = _refused(stage04, train_argv(run_a, out, stories260k, max_tokens_per_batch=longest, pad_batches_to=pad),
                     out, f"{pad} padded to a multiple of {pad} (--pad-batches-to)", "or --pad-batches-to")
    assert stage04.main(train_argv(run_a, out, stories260k, max_tokens_per_batch=longest, epochs=1)) == 0, error


def test_stale_vocab_map_from_other_prepared_data_is_refused(run_a, stories260k, stage04, tmp_path):
    other = tmp_path / "other_run"
    write_prepared_data(stories260k, other, seed=1, count=12)
    stage03 = _load_module("stage03_vocab", "03_build_vocab_mapping.py")
    assert stage03.main(["--run-dir", str(other), "--model-path", str(stories260k),
                         "--draft-vocab-size", "128"]) == 0
    out = tmp_path / "out"
    argv = train_argv(run_a, out, stories260k, vocab_mapping_dir=other / "vocab")
    error = _refused(stage04, argv, out, "stale vocabulary map", str(other / "vocab" / MANIFEST),
                     str(run_a / "hidden_states" / MANIFEST), str(other / "data" / "tokenized_data.jsonl"))
    assert "--overwrite" in error


def test_other_verifier_is_refused(run_a, stories260k, stage04, tmp_path):
    other = tmp_path / "other_verifier"
    shutil.copytree(stories260k, other)
    config = read_json(other / "tokenizer_config.json")
    config["model_max_length"] = 1234  # another tokenizer configuration: another tokenizer hash
    write_json_atomic(other / "tokenizer_config.json", config)
    out = tmp_path / "out"
    _refused(stage04, train_argv(run_a, out, other), out, "tokenizer_sha256 mismatch", f"--model-path {other}")


def test_unfinished_hidden_states_are_refused(run_a, stories260k, stage04, tmp_path):
    partial = tmp_path / "hidden_states"
    shutil.copytree(run_a / "hidden_states", partial)
    manifest = read_json(partial / MANIFEST)
    manifest["status"] = "running"
    write_json_atomic(partial / MANIFEST, manifest)
    out = tmp_path / "out"
    _refused(stage04, train_argv(run_a, out, stories260k, data_dir=partial), out, "did not finish",
             "02_extract_hidden_states")


def test_finetune_from_a_drafter_of_another_shape_is_refused(run_a, stories260k, stage04, tmp_path):
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.drafter import Eagle3Drafter
    from eagle3_pipeline.model.checkpoint import save_drafter
    from eagle3_pipeline.formats.hidden_states import open_hidden_states

    manifest, _ = open_hidden_states(run_a / "hidden_states")
    info = read_verifier_info(str(stories260k))
    wrong = Eagle3Drafter(DrafterConfig.from_verifier(info, 128, manifest["aux_layers"]))
    save_drafter(wrong, tmp_path / "drafter_128")
    out = tmp_path / "out"
    _refused(stage04, train_argv(run_a, out, stories260k, finetune_from=tmp_path / "drafter_128"), out,
             "--finetune-from", "draft_vocab_size is 128", "has 256")
    shifted = Eagle3Drafter(DrafterConfig.from_verifier(info, DRAFT_VOCAB, [1, 2, 4]))
    save_drafter(shifted, tmp_path / "drafter_layers")
    _refused(stage04, train_argv(run_a, out, stories260k, finetune_from=tmp_path / "drafter_layers"), out,
             "--finetune-from", "hidden states were stored for layers [1, 2, 3]")


def test_resume_with_other_settings_is_refused(run_a, stories260k, stage04, tmp_path):
    out = tmp_path / "out"
    flags = dict(epochs=1, save_interval=2, eval_interval=100, log_interval=1)
    assert stage04.main(train_argv(run_a, out, stories260k, **flags), hooks=[crash_at(3)]) == 1
    assert stage04.main(train_argv(run_a, out, stories260k, resume=True, **{**flags, "lr": 1e-3})) == 2
    assert "lr: was 0.005, now 0.001" in log_text(out)
    assert stage04.main(train_argv(run_a, out, stories260k, resume=True, ttt_positions="fixed", **flags)) == 2
    assert "ttt_positions: was 'shifted', now 'fixed'" in log_text(out)
    assert stage04.main(train_argv(run_a, out, stories260k, resume=True, loss="lk", **flags)) == 2
    assert "loss: was 'kl', now 'lk'" in log_text(out)
    # a run saved before --ttt-positions existed trained with fixed positions: it resumes only with those
    state_file = read_json(out / "latest.json")["checkpoint"]
    state = read_json(out / state_file / "trainer_state.json")
    del state["run_config"]["ttt_positions"]
    (out / state_file / "trainer_state.json").write_text(json.dumps(state))
    (out / state_file / "files.json").unlink()  # (saved before checkpoints recorded their checksums, too)
    assert stage04.main(train_argv(run_a, out, stories260k, resume=True, **flags)) == 2
    assert "ttt_positions: was 'fixed', now 'shifted'" in log_text(out)
    assert stage04.main(train_argv(run_a, out, stories260k, resume=True, overwrite=True, **flags)) == 2
    # --overwrite starts over cleanly
    assert stage04.main(train_argv(run_a, out, stories260k, overwrite=True, **flags)) == 0
    assert read_json(out / "latest.json")["checkpoint"] == "epoch_1"
    training = read_json(out / "latest" / "config.json")["eagle3_pipeline"]["training"]
    # scripts/sglang_launch_command.py reads them
    assert (training["ttt_positions"], training["ttt_steps"]) == ("shifted", TTT)
    steps = [r["step"] for r in records(out, "train")]  # the crashed run's lines 1..3 are gone
    assert steps == list(range(1, read_json(out / "latest.json")["total_steps"] + 1))
    # the earlier training stays reachable for an A/B, and says so
    assert stage04.main(train_argv(run_a, out, stories260k, overwrite=True, ttt_positions="fixed", **flags)) == 0
    assert read_json(out / "latest" / "config.json")["eagle3_pipeline"]["training"]["ttt_positions"] == "fixed"
    assert "--ttt-positions fixed: TTT step j keeps" in log_text(out)


# --- fine-tuning and the evaluation API --------------------------------------------------------------------

@pytest.mark.slow
def test_finetune_from_trained_drafter_and_evaluate_reproduces_validation(trained, run_a, nested_verifier,
                                                                          stories260k, stage04, tmp_path):
    from eagle3_pipeline.model.checkpoint import load_drafter
    from eagle3_pipeline.formats.hidden_states import load_sample, open_hidden_states
    from eagle3_pipeline.train.step import evaluate
    from eagle3_pipeline.verifier.loading import read_embedding_tensors

    # evaluate() on the held-out samples (single samples, as stage 05 --mode eval may pass them) reproduces
    # what training logged for the best checkpoint: the export, the load and the metric agree.
    tensors = read_embedding_tensors(str(stories260k))
    model = load_drafter(trained / "best", embed=tensors["embed_tokens"])
    _, entries = open_hidden_states(run_a / "hidden_states")
    val_ids = set(read_json(trained / "val_split.json")["val_ids"])
    samples = [load_sample(run_a / "hidden_states", e) for e in entries if e["id"] in val_ids]
    result = evaluate(model, samples, tensors["lm_head"], TTT)
    best = read_json(trained / "best.json")
    logged = next(e for e in records(trained, "eval") if e["step"] == best["step"])
    assert result["sim_accept_len"] == pytest.approx(best["val_sim_accept_len"], abs=1e-5)
    assert result["acc_per_step"] == pytest.approx(logged["acc_per_step"], abs=1e-5)
    assert result["count_per_step"] == logged["count_per_step"]

    # --finetune-from starts from that drafter: its very first validation is already near the trained level.
    out = tmp_path / "finetuned"
    assert stage04.main(train_argv(run_a, out, stories260k, finetune_from=trained / "best", epochs=1,
                                   lr=1e-4)) == 0
    first = records(out, "eval")[0]
    assert first["acc_per_step"][0] > logged["acc_per_step"][0] - 0.05
    assert read_json(out / MANIFEST)["inputs"]["finetune_from"]["path"] == str((trained / "best").resolve())


def test_without_validation_split_best_is_the_latest_epoch(run_a, stories260k, stage04, tmp_path):
    out = tmp_path / "out"
    assert stage04.main(train_argv(run_a, out, stories260k, val_ratio=0, epochs=2, save_interval=5)) == 0
    assert records(out, "eval") == []
    best = read_json(out / "best.json")
    assert best["checkpoint"] == "epoch_2" and best["metric"] == "latest epoch (no validation split)"
    assert (out / "best").resolve() == (out / "epoch_2").resolve()
    assert read_json(out / "val_split.json")["val_ids"] == []


def test_profile_steps_writes_where_the_steps_spend_their_time(run_a, stories260k, stage04, tmp_path):
    """--profile-steps 2: the two steps after the warm-up (earlier in a run too short for it) are profiled
    inside the real loop; the log says so and profile_steps.txt holds the host-time table of stage 04's own
    operations. The training itself is the same as without it."""
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    assert stage04.main(train_argv(run_a, plain, stories260k, epochs=1)) == 0
    assert stage04.main(train_argv(run_a, profiled, stories260k, epochs=1, profile_steps=2)) == 0
    text = (profiled / "profile_steps.txt").read_text()
    assert text.startswith("2 steps profiled (steps ") and "(CPU: no device time)" in text
    assert "By host time:" in text and "aten::mm" in text and "By device time:" not in text
    assert "--profile-steps: 2 steps profiled" in log_text(profiled)
    # with room for both, the 2 steps before the profiled ones are timed without the profiler
    assert re.search(r"the 2 steps before, without the profiler: [0-9.]+ ms a step", text.splitlines()[0])
    assert not (plain / "profile_steps.txt").exists()
    assert [r["loss"] for r in records(profiled, "train")] == [r["loss"] for r in records(plain, "train")]


def test_padding_batches_to_a_multiple_changes_shapes_not_training(run_a, stories260k, stage04, tmp_path):
    """--pad-batches-to (64 by default on a GPU, so that batch shapes repeat; 1 on a CPU): batch lengths are
    multiples of it (FP8's alignment kept), a padded batch stays within --max-tokens-per-batch, and the padded
    tokens change neither the losses nor the validation where the plan is the same (decided by --batch-size)."""
    from eagle3_pipeline.train.data import batch_length_multiple, collate, plan_batches, round_up
    from eagle3_pipeline.train.inputs import default_pad_batches_to

    assert (default_pad_batches_to("cuda:0"), default_pad_batches_to("cpu")) == (64, 1)
    assert [batch_length_multiple(*case) for case in ((64, False), (64, True), (1, True), (1, False))] == [64, 64, 16, 1]
    lengths = [70, 130, 5, 64, 200, 199, 1, 65, 120, 3]
    plan = plan_batches(lengths, 384, 8, seed=0, epoch=0, pad_to=64)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    assert all(len(batch) * max(round_up(lengths[i], 64) for i in batch) <= 384 for batch in plan)
    unaware = plan_batches(lengths, 384, 8, seed=0, epoch=0)  # the plan that does not count the padding
    assert any(len(batch) * max(round_up(lengths[i], 64) for i in batch) > 384 for batch in unaware)
    sample = {"input_ids": torch.arange(70), "loss_mask": torch.ones(70), "final": torch.zeros(70, 4)}
    assert collate([sample], pad_to=64)["input_ids"].shape == (1, 128)

    runs = {pad: tmp_path / f"pad{pad}" for pad in (None, 64)}  # None: the CPU's default, unpadded
    for pad, out in runs.items():
        assert stage04.main(train_argv(run_a, out, stories260k, epochs=1, pad_batches_to=pad,
                                       max_tokens_per_batch=100_000)) == 0
    recorded = [read_json(out / read_json(out / "latest.json")["checkpoint"] / "trainer_state.json") for out in runs.values()]
    assert [state["run_config"]["pad_batches_to"] for state in recorded] == [1, 64]
    for kind in ("train", "eval"):
        ours, theirs = records(runs[64], kind), records(runs[None], kind)
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["tokens"] == b["tokens"]


def test_min_steps_puts_fewer_sequences_in_a_step_until_the_plan_gives_enough(run_a, stories260k, stage04, tmp_path):
    """--min-steps (default 2000): a plan that gives fewer optimizer steps puts fewer sequences in each micro-batch
    (one at least) and records the cap, so that a resume plans the same; enough steps: no change. A resume whose
    --min-steps gives another cap is refused, naming the run's value."""
    from eagle3_pipeline.train.data import sequences_for_min_steps

    lengths, unlimited = [100] * 40, 1 << 30  # ten sequences fill a 1,000-token batch: 4 batches an epoch
    assert sequences_for_min_steps(lengths, 1000, unlimited, 2, 1, 8, seed=0) == unlimited  # 8 steps already
    assert sequences_for_min_steps(lengths, 1000, unlimited, 2, 1, 20, seed=0) == 4  # 10 batches an epoch
    assert sequences_for_min_steps(lengths, 1000, unlimited, 2, 2, 20, seed=0) == 2  # two micro-batches a step
    assert sequences_for_min_steps(lengths, 1000, unlimited, 2, 1, 10_000, seed=0) == 1
    assert sequences_for_min_steps(lengths, 1000, unlimited, 2, 1, 0, seed=0) == unlimited

    plain, capped = tmp_path / "plain", tmp_path / "capped"
    assert stage04.main(train_argv(run_a, plain, stories260k, epochs=1)) == 0
    planned = read_json(plain / "latest.json")["total_steps"]
    assert stage04.main(train_argv(run_a, capped, stories260k, epochs=1, min_steps=2 * planned)) == 0
    assert read_json(capped / "latest.json")["total_steps"] >= 2 * planned
    state = read_json(capped / read_json(capped / "latest.json")["checkpoint"] / "trainer_state.json")
    assert state["run_config"]["min_steps"] == 2 * planned and state["run_config"]["max_sequences"] < 8
    assert f"--min-steps {2 * planned}: the batch plan gives fewer optimizer steps" in log_text(capped)

    # the default: this small run's plan is far below 2,000 steps, so one sequence a micro-batch
    default = tmp_path / "default"
    assert stage04.main(train_argv(run_a, default, stories260k, epochs=1, min_steps=None, save_interval=2)) == 0
    config = read_json(default / read_json(default / "latest.json")["checkpoint"] / "trainer_state.json")["run_config"]
    assert (config["min_steps"], config["max_sequences"]) == (2000, 1)
    # resuming the --min-steps 0 run under the default would change its plan: refused, with the flag to give
    assert stage04.main(train_argv(run_a, plain, stories260k, epochs=1, resume=True, min_steps=None)) == 2
    assert "max_sequences: was 8, now 1" in log_text(plain) and "give the run's --min-steps, 0" in log_text(plain)
    # the cap is compared, not the flag: another --min-steps giving the same cap resumes (so do runs saved before it)
    assert stage04.main(train_argv(run_a, default, stories260k, epochs=1, resume=True, min_steps=1000)) == 0
    assert "training already finished at step" in log_text(default)


def test_a_checkpoint_failing_its_check_stops_the_run(stories260k, tmp_path):
    """check_drafter_dir runs after every save; a failure raises and `latest` keeps the last good folder."""
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.drafter import Eagle3Drafter
    from eagle3_pipeline.model.checkpoint import check_drafter_dir
    from eagle3_pipeline.train.checkpoints import CheckpointManager

    info = read_verifier_info(str(stories260k))
    model = Eagle3Drafter(DrafterConfig.from_verifier(info, 512, [1, 2, 3]))
    with torch.no_grad():
        model.t2d.fill_(True)  # identity map over the whole vocabulary
    good = {"aux_layers": [1, 2, 3], "verifier": info.identity()}
    manager = CheckpointManager(tmp_path, keep_last=2, validate=lambda p: check_drafter_dir(p, good, info))
    manager.save("step_000001", model, {"step": 1}, {"step": 1})
    assert read_json(tmp_path / "latest.json")["checkpoint"] == "step_000001"
    shifted = {"aux_layers": [1, 2, 4], "verifier": info.identity()}  # hidden states of other layers
    manager.validate = lambda p: check_drafter_dir(p, shifted, info)
    with pytest.raises(RuntimeError, match="fails check_drafter_dir"):
        manager.save("step_000002", model, {"step": 2}, {"step": 2})
    assert read_json(tmp_path / "latest.json")["checkpoint"] == "step_000001"


@pytest.mark.slow
def test_bf16_resume_restores_fp32_master_weights_and_moments(run_a, stories260k, tmp_path):
    """The GPU configuration (bf16 parameters, fp32 master weights and moments in the optimizer), run on CPU
    at the Trainer level: a resumed run must end bit-identical, which needs the fp32 optimizer state back
    in fp32 (torch's load_state_dict alone casts it to bf16)."""
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.drafter import Eagle3Drafter
    from eagle3_pipeline.formats.hidden_states import open_hidden_states
    from eagle3_pipeline.train.data import HiddenStateDataset
    from eagle3_pipeline.train.parameters import cast_parameters
    from eagle3_pipeline.train.step import TrainConfig
    from eagle3_pipeline.train.trainer import LoopConfig, Trainer
    from eagle3_pipeline.verifier.loading import read_embedding_tensors
    from eagle3_pipeline.formats.vocab_map import load_mapping

    manifest, entries = open_hidden_states(run_a / "hidden_states")
    info = read_verifier_info(str(stories260k))
    mapping = load_mapping(run_a / "vocab")
    tensors = read_embedding_tensors(str(stories260k))

    def make_trainer(out: Path, hooks=()) -> Trainer:
        torch.manual_seed(0)
        model = Eagle3Drafter(DrafterConfig.from_verifier(info, DRAFT_VOCAB, manifest["aux_layers"]))
        model.init_from_verifier(tensors["embed_tokens"], tensors["lm_head"], mapping.d2t, mapping.t2d)
        cast_parameters(model, torch.bfloat16)
        out.mkdir(exist_ok=True)
        return Trainer(model, tensors["lm_head"].bfloat16(), TrainConfig(lr=5e-3, ttt_steps=2, dtype="bfloat16",
                                                                         noise_std=0.05),
                       LoopConfig(epochs=1, max_tokens=384, max_sequences=8, eval_interval=100, save_interval=3),
                       HiddenStateDataset(run_a / "hidden_states", entries[:36], 2048),
                       HiddenStateDataset(run_a / "hidden_states", entries[36:44], 2048), out, 2, {}, hooks=hooks)

    whole = make_trainer(tmp_path / "whole")
    whole.fit()
    assert whole.model.inv_freq.dtype == torch.float32  # RoPE frequencies not rounded to bf16
    assert all(s["master"].dtype == torch.float32 for s in whole.optimizer.state.values())
    with pytest.raises(Crash):
        make_trainer(tmp_path / "broken", hooks=[crash_at(5)]).fit()
    resumed = make_trainer(tmp_path / "broken")
    resumed.load_training_state(resumed.checkpoints.resume_point())
    assert resumed.state.step == 3
    assert all(s["exp_avg"].dtype == torch.float32 for s in resumed.optimizer.state.values())
    resumed.fit()
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


# --- the drafter's layer from the verifier's ------------------------------------------------------------

def test_init_from_verifier_layer_starts_the_layer_as_the_verifiers_last(run_a, stories260k, stage04, tmp_path):
    """--init-from-verifier-layer: with lr 0 the exported layer is its starting point, the verifier's last
    decoder layer (q/k/v on the hidden half of the input, zeros on the embedding half; o_proj, MLP and norms as
    they are); with training it learns; a layer shape the drafter does not have, and --finetune-from, are refused."""
    from safetensors.torch import load_file
    from eagle3_pipeline.verifier.loading import read_layer_tensors, read_verifier_info

    last = read_verifier_info(str(stories260k)).num_layers - 1
    verifier = read_layer_tensors(str(stories260k), last)
    frozen = tmp_path / "frozen"
    assert stage04.main(train_argv(run_a, frozen, stories260k, epochs=1, lr=0.0, init_from_verifier_layer=True)) == 0
    assert f"starts from the verifier's layer {last}" in log_text(frozen)
    weights = load_file(str(frozen / "best" / "model.safetensors"))
    hidden = verifier["o_proj"].shape[0]

    def same(ours, theirs):
        assert torch.equal(ours, theirs.to(ours.dtype)), (ours.shape, theirs.shape)

    for role in ("q_proj", "k_proj", "v_proj"):
        ours = weights[f"midlayer.self_attn.{role}.weight"]
        same(ours[:, hidden:], verifier[role])
        assert not ours[:, :hidden].any()
    same(weights["midlayer.self_attn.o_proj.weight"], verifier["o_proj"])
    for role in ("gate_proj", "up_proj", "down_proj"):
        same(weights[f"midlayer.mlp.{role}.weight"], verifier[role])
    same(weights["midlayer.hidden_norm.weight"], verifier["input_layernorm"])
    same(weights["midlayer.post_attention_layernorm.weight"], verifier["post_attention_layernorm"])
    assert read_json(frozen / "best" / "trainer_state.json")["run_config"]["init_from_verifier_layer"] is True

    trained = tmp_path / "trained"
    assert stage04.main(train_argv(run_a, trained, stories260k, epochs=2, eval_interval=1000,
                                   init_from_verifier_layer=True)) == 0
    evals = [row for row in map(json.loads, (trained / "metrics.jsonl").read_text().splitlines())
             if row["kind"] == "eval"]
    assert len(evals) == 2 and evals[1]["sim_accept_len"] > evals[0]["sim_accept_len"]  # one each epoch: it learns
    moved = load_file(str(trained / "best" / "model.safetensors"))["midlayer.mlp.down_proj.weight"]
    assert not torch.equal(moved, verifier["down_proj"].to(moved.dtype))  # it trained from there

    other = tmp_path / "other"
    _refused(stage04, train_argv(run_a, other, stories260k, init_from_verifier_layer=True,
                                 drafter_config='{"intermediate_size": 176}'), other,
             "--init-from-verifier-layer", "gate_proj", "176")
    _refused(stage04, train_argv(run_a, other, stories260k, init_from_verifier_layer=True,
                                 finetune_from=frozen / "best"), other,
             "--init-from-verifier-layer", "--finetune-from")


def test_lk_loss_learns_and_validation_keeps_the_soft_ce(run_a, stories260k, stage04, tmp_path):
    """--loss lk trains on -log(acceptance probability): agreement and both simulated taus rise, the training
    lines carry the LK loss and validation the soft-CE (comparable with a --loss kl run), and the run's
    configuration records it."""
    out = tmp_path / "lk"
    assert stage04.main(train_argv(run_a, out, stories260k, epochs=3, loss="lk", eval_interval=1000)) == 0
    train, evals = records(out, "train"), records(out, "eval")
    assert len(evals) == 3 and evals[-1]["acc_per_step"][0] > evals[0]["acc_per_step"][0]
    assert evals[-1]["sim_chain_tau"] > evals[0]["sim_chain_tau"]
    kl = tmp_path / "kl"
    assert stage04.main(train_argv(run_a, kl, stories260k, epochs=1, eval_interval=1000)) == 0
    # training lines carry -log(alpha) (measured: 7.3 for the fresh drafter against a soft-CE of 12.9);
    # validation the soft-CE in both runs: after an epoch, nearer the other run's than its own training loss
    kl_train, kl_eval = records(kl, "train")[0]["loss"], records(kl, "eval")[0]["loss"]
    assert abs(train[0]["loss"] - kl_train) > 1.0
    assert abs(evals[0]["loss"] - kl_eval) < abs(evals[0]["loss"] - train[-1]["loss"])
    assert read_json(out / "best" / "trainer_state.json")["run_config"]["loss"] == "lk"
    # the last line gives the figure to compare with stage 05: the last validation's walked chain tau
    assert f"walked chain tau {evals[-1]['sim_chain_tau']:.3f} (the figure to compare" in log_text(out)

