"""Stage 02's storage formats (eagle3_pipeline/formats/storage.py) end to end on stories260K, on CPU: FP8 aux layers
with per-token scales and top-k targets, written by the real stage 02, read by stage 04 (which learns from them and
resumes exactly) and by stage 05 --mode eval; and the refusals (an unknown format, two formats in one folder)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.files import read_json, write_json_atomic
from eagle3_pipeline.formats.hidden_states import estimate_disk_bytes, load_sample, open_hidden_states
from eagle3_pipeline.formats.storage import (FP8_MAX, StorageFormat, dequantize_fp8, format_of_manifest, id_dtype,
                                             quantize_fp8)
from conftest import REPO
from test_train import _load_module, crash_at, final_weights, records, train_argv, write_prepared_data

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TOPK = 16
FORMATS = {"fp8_final": ["--aux-dtype", "float8_e4m3"], "bf16_topk": ["--targets", "topk", "--target-topk", str(TOPK)],
           "fp8_topk": ["--aux-dtype", "float8_e4m3", "--targets", "topk", "--target-topk", str(TOPK)]}
# e4m3 keeps 3 mantissa bits: rounding is within 2^-4 of a value, or half the smallest subnormal step (2^-10 of
# the row's scale) for values that small.
FP8_REL, FP8_ABS = 2.0 ** -4, 2.0 ** -10


def fp8_error_bound(reference: torch.Tensor) -> torch.Tensor:
    scale = reference.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    return FP8_REL * reference.abs() + FP8_ABS * scale + 1e-30


@pytest.fixture(scope="module")
def stages():
    return {n: _load_module(f"stage{n}_storage", f) for n, f in (("02", "02_extract_hidden_states.py"),
                                                                 ("03", "03_build_vocab_mapping.py"),
                                                                 ("04", "04_train.py"), ("05", "05_benchmark.py"))}


def extract(stages, run: Path, model: Path, *extra: str) -> int:
    return stages["02"].main(["--run-dir", str(run), "--model-path", str(model), "--device", "cpu",
                              "--num-workers", "1", "--dtype", "float32", *extra])


@pytest.fixture(scope="module")
def runs(stories260k, stages, tmp_path_factory) -> dict[str, Path]:
    """One run directory per format (the same prepared data and vocabulary map), the reference in float32."""
    base = tmp_path_factory.mktemp("formats")
    reference = base / "reference"
    write_prepared_data(stories260k, reference, seed=0)
    assert stages["03"].main(["--run-dir", str(reference), "--model-path", str(stories260k),
                              "--draft-vocab-size", "256"]) == 0
    assert extract(stages, reference, stories260k) == 0
    found = {"reference": reference}
    for name, flags in FORMATS.items():
        run = base / name
        shutil.copytree(reference / "data", run / "data")
        shutil.copytree(reference / "vocab", run / "vocab")
        assert extract(stages, run, stories260k, *flags) == 0
        found[name] = run
    return found


def samples_of(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    folder = run / "hidden_states"
    _, entries = open_hidden_states(folder)
    return {entry["id"]: load_sample(folder, entry) for entry in entries}


# --- the encodings ----------------------------------------------------------------------------------------------

def test_fp8_round_trip_is_within_fp8_rounding_of_each_token():
    """Rows whose magnitudes differ by 10^8, as tokens' hidden states can (an attention sink's row is huge): each
    row keeps FP8's relative precision, which one scale for the whole tensor could not give the small rows."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 256, generator=gen) * torch.logspace(-4, 4, 64)[:, None]
    rows[3] = 0.0  # an all-zero row stays zero, without NaN
    values, scale = quantize_fp8(rows)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (64,) and scale.dtype == torch.float32
    back = dequantize_fp8(values, scale[:, None], torch.float32)
    error = (back - rows).abs()
    assert bool((error <= fp8_error_bound(rows)).all())
    assert torch.equal(back[3], rows[3])
    relative = error.sum(-1) / rows.abs().sum(-1).clamp(min=1e-30)
    assert float(relative.max()) < 0.04 and float(relative[rows.abs().sum(-1) > 0].min()) > 0  # per row, lossy
    # several layers side by side ([S, 3H] with a scale per layer) decode layer by layer
    pairs = [quantize_fp8(rows[:, :128] * 10.0 ** k) for k in range(3)]
    joined = dequantize_fp8(torch.cat([v for v, _ in pairs], -1), torch.stack([s for _, s in pairs], -1), torch.float32)
    for k in range(3):
        torch.testing.assert_close(joined[:, 128 * k:128 * (k + 1)],
                                   dequantize_fp8(pairs[k][0], pairs[k][1][:, None], torch.float32))


def test_id_dtype_and_bytes_per_token():
    assert [id_dtype(v) for v in (256, 512, 49152, 65536, 128256, 163840)] == \
        [torch.uint8, torch.uint16, torch.uint16, torch.uint16, torch.int32, torch.int32]
    hidden = 7168  # Kimi-K2.5
    plain = StorageFormat("bfloat16", "final", 64, 163840, "bfloat16")
    assert plain.bytes_per_token(hidden) == 4 * hidden * 2
    fp8_topk = StorageFormat("float8_e4m3", "topk", 64, 163840, "bfloat16")
    assert fp8_topk.bytes_per_token(hidden) == 3 * hidden + 3 * 4 + 64 * (4 + 2)
    assert fp8_topk.bytes_per_token(hidden) < 0.4 * plain.bytes_per_token(hidden)
    assert estimate_disk_bytes(1000, 1, hidden, 0, fp8_topk) < estimate_disk_bytes(1000, 1, hidden, 2)


# --- stage 02 ---------------------------------------------------------------------------------------------------

def test_stage02_writes_fp8_aux_close_to_the_exact_states(runs):
    reference = samples_of(runs["reference"])
    for name in ("fp8_final", "fp8_topk"):
        stored = samples_of(runs[name])
        assert stored.keys() == reference.keys()
        for sample_id, sample in stored.items():
            exact = reference[sample_id]["aux"]
            assert sample["aux"].dtype == torch.float8_e4m3fn and sample["aux_scale"].shape == (exact.shape[0], 3)
            assert torch.equal(sample["input_ids"], reference[sample_id]["input_ids"])
            back = dequantize_fp8(sample["aux"], sample["aux_scale"], torch.float32)
            bounds = torch.cat([fp8_error_bound(part) for part in exact.chunk(3, dim=-1)], dim=-1)
            assert bool(((back - exact).abs() <= bounds).all()), sample_id
        if name == "fp8_final":  # final is untouched
            assert all(torch.equal(s["final"], reference[i]["final"]) for i, s in stored.items())


def test_topk_targets_are_the_top_k_of_the_verifiers_own_logits(runs, stories260k):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    for name in ("bf16_topk", "fp8_topk"):
        for sample_id, sample in list(samples_of(runs[name]).items())[:12]:
            assert "final" not in sample and sample["topk_ids"].dtype == torch.uint16  # vocabulary of 512
            with torch.no_grad():
                logits = model(sample["input_ids"][None]).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            best = logprobs.topk(TOPK, dim=-1).values
            ids = sample["topk_ids"].long()
            torch.testing.assert_close(sample["topk_logprobs"].float(), best, rtol=2e-3, atol=1e-3)
            # the stored ids are those tokens (ties aside: their own log-probabilities are the top k)
            torch.testing.assert_close(logprobs.gather(-1, ids), best, rtol=1e-4, atol=1e-4)
            assert all(len(set(row)) == TOPK for row in ids.tolist())


def test_manifest_disk_estimate_status_and_bytes_follow_the_format(runs):
    sizes = {}
    for name, run in runs.items():
        manifest = read_json(run / "hidden_states" / "manifest.json")
        fmt = format_of_manifest(manifest, name)
        stored = sum(p.stat().st_size for p in (run / "hidden_states").glob("shard_*/*/*.pt"))
        sizes[name] = stored
        assert manifest["planned_bytes"] >= stored  # the preflight's estimate covers what was written
        assert manifest["counts"]["files"] == manifest["counts"]["samples"] * len(fmt.files())
        files = {p.name for p in next((run / "hidden_states").glob("shard_*/*")).glob("*.pt")}
        assert files == set(fmt.files())
    assert read_json(runs["fp8_topk"] / "hidden_states" / "manifest.json")["storage"] == {
        **read_json(runs["fp8_topk"] / "hidden_states" / "manifest.json")["storage"],
        "aux_dtype": "float8_e4m3", "targets": "topk", "target_topk": TOPK, "topk_id_dtype": "uint16"}
    assert sizes["fp8_final"] < sizes["reference"] and sizes["fp8_topk"] < sizes["bf16_topk"] < sizes["reference"]
    import subprocess
    import sys

    status = subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "--run-dir", str(runs["fp8_topk"]),
                             "--status"], capture_output=True, text=True)
    assert f"aux float8_e4m3, targets top-{TOPK}" in status.stdout, status.stdout + status.stderr


def test_a_rerun_with_another_format_is_refused_and_older_runs_keep_working(runs, stories260k, stages, tmp_path):
    run = runs["fp8_final"]
    before = {p: p.stat().st_mtime_ns for p in (run / "hidden_states").glob("shard_*/*/*.pt")}
    assert extract(stages, run, stories260k) == 2  # bf16 into an FP8 folder: samples of two formats
    log = (run / "logs" / "02_extract_hidden_states.log").read_text()
    assert "storage: was 'aux float8_e4m3, targets final', now 'aux float32, targets final'" in log
    assert "--overwrite" in log.splitlines()[-1] or "--overwrite" in log
    assert {p: p.stat().st_mtime_ns for p in (run / "hidden_states").glob("shard_*/*/*.pt")} == before
    assert extract(stages, run, stories260k, *FORMATS["fp8_final"]) == 0  # its own format: nothing to do

    # A run made before formats existed (no "storage" in its manifest) reads and resumes as aux in --dtype + final.
    old = tmp_path / "old"
    shutil.copytree(runs["reference"], old)
    manifest_path = old / "hidden_states" / "manifest.json"
    manifest = read_json(manifest_path)
    del manifest["storage"]
    write_json_atomic(manifest_path, manifest)
    _, entries = open_hidden_states(old / "hidden_states")
    assert "final" in load_sample(old / "hidden_states", entries[0])
    assert extract(stages, old, stories260k) == 0
    assert "nothing to do" in (old / "logs" / "02_extract_hidden_states.log").read_text()
    assert extract(stages, old, stories260k, "--targets", "topk") == 2


def test_writing_in_the_calling_thread_gives_the_same_files_and_repair_keeps_the_format(runs, stories260k, stages,
                                                                                      tmp_path):
    """--num-workers 0 (no writer processes) writes the very bytes the writer processes wrote; the repair command
    a damaged sample's error names carries the format's flags (without them the rerun would be refused)."""
    from eagle3_pipeline.formats.hidden_states import rerun_command

    run = tmp_path / "inline"
    shutil.copytree(runs["fp8_topk"] / "data", run / "data")
    assert stages["02"].main(["--run-dir", str(run), "--model-path", str(stories260k), "--device", "cpu",
                              "--num-workers", "0", "--dtype", "float32", *FORMATS["fp8_topk"]]) == 0
    ours = {e["id"]: e["files"] for e in map(json.loads, (run / "hidden_states" / "index.jsonl").open())}
    theirs = {e["id"]: e["files"] for e in map(json.loads, (runs["fp8_topk"] / "hidden_states" / "index.jsonl").open())}
    assert ours == theirs and len(ours) > 50
    assert f"--aux-dtype float8_e4m3 --targets topk --target-topk {TOPK}" in rerun_command(run / "hidden_states")
    assert "--aux-dtype" not in rerun_command(runs["reference"] / "hidden_states")


def test_the_reader_refuses_a_format_it_does_not_know(runs, stories260k, stages, tmp_path):
    run = tmp_path / "future"
    shutil.copytree(runs["fp8_topk"], run)
    manifest_path = run / "hidden_states" / "manifest.json"
    manifest = read_json(manifest_path)
    manifest["storage"]["aux_dtype"] = "float4_e2m1"
    write_json_atomic(manifest_path, manifest)
    with pytest.raises(UsageError, match="float4_e2m1.*a format this code does not read"):
        open_hidden_states(run / "hidden_states")
    assert stages["04"].main(train_argv(run, tmp_path / "ckpt", stories260k, epochs=1)) == 2


# --- stages 04 and 05 -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_training_learns_from_each_format(name, runs, stories260k, stages, tmp_path):
    out = tmp_path / "ckpt"
    assert stages["04"].main(train_argv(runs[name], out, stories260k, epochs=4, eval_interval=1000,
                                        save_interval=1000, keep_last=1)) == 0
    evals = records(out, "eval")
    for j in range(3):
        assert evals[-1]["acc_per_step"][j] > evals[0]["acc_per_step"][j] + 0.05, [e["acc_per_step"] for e in evals]
    assert evals[-1]["sim_accept_len"] > evals[0]["sim_accept_len"] + 0.1
    if "topk" in name:  # the probability the 16 kept tokens leave out, reported (small on these stories)
        assert all(0.0 < e["target_missing_mass"] < 0.2 for e in evals)
        assert all(0.0 < r["target_missing_mass"] < 0.2 for r in records(out, "train"))
    else:
        assert all("target_missing_mass" not in e for e in evals)

    if name == "fp8_topk":  # stage 05 --mode eval reads the same format and reproduces the validation
        bench = tmp_path / "bench"
        assert stages["05"].main(["--mode", "eval", "--data-dir", str(runs[name] / "hidden_states"),
                                  "--draft-model-path", str(out / "best"), "--model-path", str(stories260k),
                                  "--output-dir", str(bench), "--num-steps", "3", "--device", "cpu"]) == 0
        [path] = bench.glob("bench_eval_ttt3_*.json")
        metrics = json.loads(path.read_text())["metrics"]
        best = read_json(out / "best.json")
        assert metrics["sim_accept_len"] == pytest.approx(best["val_sim_accept_len"], abs=1e-5)
        assert 0.0 < metrics["target_missing_mass"] < 0.2


@pytest.mark.slow
def test_training_from_fp8_and_topk_resumes_exactly(runs, stories260k, stages, tmp_path):
    flags = dict(epochs=2, grad_accum=2, noise_std=0.05, save_interval=4, eval_interval=3, keep_last=1,
                 log_interval=3, ttt_steps=2)
    run, whole, broken = runs["fp8_topk"], tmp_path / "whole", tmp_path / "broken"
    assert stages["04"].main(train_argv(run, whole, stories260k, **flags)) == 0
    assert stages["04"].main(train_argv(run, broken, stories260k, **flags), hooks=[crash_at(6)]) == 1
    assert stages["04"].main(train_argv(run, broken, stories260k, resume=True, **flags)) == 0
    ours, theirs = records(broken, "eval"), records(whole, "eval")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["acc_per_step"] == pytest.approx(b["acc_per_step"], abs=1e-6)
    expected, got = final_weights(whole), final_weights(broken)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7, msg=key)


def test_the_sglang_backend_refuses_the_new_formats(runs, stories260k, stages):
    """patches/sglang_capture.py writes --dtype aux and final only: the stage says so before starting anything."""
    run = runs["reference"]
    for flags in FORMATS.values():
        assert stages["02"].main(["--run-dir", str(run), "--model-path", str(stories260k), "--backend", "sglang",
                                  *flags]) == 2
        last = (run / "logs" / "02_extract_hidden_states.log").read_text().splitlines()[-1]
        assert "patches/sglang_capture.py" in last and "use --backend hf" in last, last
