"""SpecForge 0.2.0's training recipe on our data (scripts/lab/train_specforge_recipe.py), on CPU with stories260K.

A real run directory (stages 01-03 as in test_train.py, plus a one-epoch stage 04 whose settings and validation
split the recipe takes over) is trained a few steps with SpecForge's own drafter, loss, optimizer and trainer
step, exported to our checkpoint format, and loaded back with stage 05's load_drafter: its teacher-forced
logits must equal the SpecForge model's on the same input. SpecForge is not one of our dependencies: these tests
skip where `import specforge` fails (CI installs it with `pip install --no-deps specforge==0.2.0`, see
requirements-test.txt). On CPU its Triton KL loss is replaced by SpecForge's own torch reference of it.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.formats.files import write_json_atomic
from conftest import REPO, run_script
from test_train import ONE_THREAD, build_run, train_argv

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STEPS = 6


def _script():
    spec = importlib.util.spec_from_file_location("train_specforge_recipe",
                                                  REPO / "scripts" / "lab" / "train_specforge_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _need_specforge():
    from eagle3_pipeline.peer.specforge import INSTALL_HINT, specforge_importable

    if not specforge_importable():
        pytest.skip(f"SpecForge is not installed ({INSTALL_HINT})")


@pytest.fixture(scope="module")
def run_dir(stories260k, tmp_path_factory) -> Path:
    """Stages 01-03, then a one-epoch stage 04 (its flags and val_split.json are what the recipe reads)."""
    _need_specforge()
    run = build_run(stories260k, tmp_path_factory.mktemp("sf_run"), seed=0)
    done = run_script("04_train.py", *train_argv(run, run / "checkpoints", stories260k, epochs=1), env=ONE_THREAD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def trained(run_dir, stories260k):
    """The recipe run in this process (the test needs SpecForge's trained model object), float32 for exactness."""
    from eagle3_pipeline.cli.stage import setup_logging
    from eagle3_pipeline.peer.specforge_run import run_recipe

    script = _script()
    args = script.parse(["--run-dir", str(run_dir), "--device", "cpu", "--dtype", "float32", "--max-steps",
                         str(STEPS), "--num-workers", "0"])
    log = setup_logging(script.STAGE, run_dir / "logs")
    recipe, results = run_recipe(args, log)
    return recipe, results


def test_recipe_takes_our_settings_and_split_and_records_the_run(run_dir, trained):
    _, results = trained
    ours = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())["flags"]
    split = json.loads((run_dir / "checkpoints" / "val_split.json").read_text())
    settings, sources = results["settings"], results["setting_sources"]
    assert (settings["lr"], settings["seed"], settings["ttt_steps"], settings["epochs"]) == (
        ours["lr"], ours["seed"], ours["ttt_steps"], ours["epochs"])
    assert settings["max_length"] == ours["max_seq_len"]
    assert all(sources[k] == "our stage 04 run" for k in ("lr", "seed", "ttt_steps", "epochs", "max_length"))
    # SpecForge's own defaults for the rest, and said so.
    assert settings["warmup_ratio"] == 0.015 and settings["max_grad_norm"] == 0.5 and settings["lr_scheduler"] == "cosine"
    assert results["specforge_defaults_used"]["ploss_decay"] == 0.8 and results["specforge_defaults_used"]["batch_size"] == 1
    assert results["train_samples"] == split["train_samples"]  # the same samples ours trained on
    assert results["planned_steps"] == split["train_samples"] * ours["epochs"]  # one sequence per step
    assert results["steps"] == STEPS and results["stopped_early"] == "max_steps"
    history = [json.loads(line) for line in (run_dir / "specforge" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    assert results["tokens"] == sum(row["tokens"] for row in history) > 0
    assert all(0.0 <= row[f"acc_{j}"] <= 1.0 for row in history for j in range(ours["ttt_steps"]))
    assert results["final_train"]["acc_0"] == pytest.approx(
        sum(r["acc_0"] * r["tokens"] for r in history) / results["tokens"], abs=1e-4)
    # The warmup (1.5% of the planned steps, i.e. none here) is over: the cosine has started from our lr.
    assert history[0]["lr"] == pytest.approx(ours["lr"], rel=1e-3) and history[-1]["lr"] < history[0]["lr"]
    assert results["wall_time_s"] > 0 and results["tokens_per_s"] > 0 and results["ours"]["status"] == "complete"
    assert any("_compute_loss" in s for s in results["cpu_substitutions"])


def test_export_is_exact_and_stage05_loads_it(run_dir, trained, stories260k):
    from eagle3_pipeline.model.checkpoint import check_drafter_dir, load_drafter
    from eagle3_pipeline.formats.hidden_states import load_sample, open_hidden_states
    from eagle3_pipeline.verifier.loading import read_embedding_tensors

    recipe, results = trained
    best = Path(results["drafter"])
    assert best == run_dir / "specforge" / "best"
    data_manifest, entries = open_hidden_states(run_dir / "hidden_states")
    assert check_drafter_dir(best, data_manifest=data_manifest) == []
    config = json.loads((best / "config.json").read_text())
    ours_config = json.loads((run_dir / "checkpoints" / "best" / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "draft_vocab_size", "vocab_size", "eagle_config",
                "eagle_aux_hidden_state_layer_ids"):
        assert config[key] == ours_config[key]
    assert "SpecForge" in config["eagle3_pipeline"]["trained_by"]

    theirs = recipe.draft_model.eval()
    embed = read_embedding_tensors(str(stories260k))["embed_tokens"]
    ours = load_drafter(best, embed=embed, dtype=torch.float32).eval()
    assert torch.equal(ours.d2t, theirs.d2t.cpu()) and torch.equal(ours.t2d, theirs.t2d.cpu())
    # It trained: SpecForge initialises lm_head at random, and the exported one is that trained head.
    assert torch.equal(ours.lm_head.weight, theirs.lm_head.weight.detach())
    sample = load_sample(run_dir / "hidden_states", entries[0])
    ids, aux = sample["input_ids"][None].long(), sample["aux"][None].float()
    with torch.no_grad():
        their_hidden = theirs(hidden_states=aux, inputs_embeds=theirs.embed_input_ids(ids))  # post-norm
        their_logits = theirs.lm_head(their_hidden)
        positions = torch.arange(ids.shape[1])[None]
        _, our_logits = ours.decode(ids, ours.fuse(aux), positions)
    torch.testing.assert_close(our_logits, their_logits, rtol=1e-4, atol=1e-5)
    assert (our_logits.argmax(-1) == their_logits.argmax(-1)).all()


def test_benchmark_runs_the_exported_drafter(run_dir, trained, stories260k, tmp_path):
    """`05_benchmark.py --draft-model-path RUN_DIR/specforge/best` decodes with it (tau only, raw prompts)."""
    from test_benchmark import bench_prompts

    out = tmp_path / "bench"
    done = run_script("05_benchmark.py", "--mode", "offline", "--run-dir", str(run_dir), "--model-path",
                      str(stories260k), "--draft-model-path", str(run_dir / "specforge" / "best"), "--prompts",
                      str(bench_prompts(tmp_path)), "--max-new-tokens", "16", "--device", "cpu", "--dtype",
                      "float32", "--output-dir", str(out), "--tau-only", "--num-prompts", "2", env=ONE_THREAD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(next(out.glob("bench_offline_k3_t0_tau_*.json")).read_text())
    assert results["overall"]["tau"] >= 1.0
    assert results["overall"]["greedy_match"]["turns_identical"] == results["overall"]["greedy_match"]["turns_checked"]
    # The recipe's manifest leads stage 05 from the drafter back to stage 01 (whose prompt hashes this plain-text
    # run has none of: that part is test_benchmark's).
    visited = results["overlap_check"]["manifests_visited"]
    assert str(run_dir / "specforge" / "manifest.json") in visited
    assert str(run_dir / "hidden_states" / "manifest.json") in visited and str(run_dir / "data" / "manifest.json") in visited


def test_missing_specforge_is_a_usage_error_naming_the_install(tmp_path, monkeypatch, capsys):
    """Fault injected: `import specforge` fails as it does where the wheel is not installed."""
    monkeypatch.setitem(sys.modules, "specforge", None)
    script = _script()
    assert script.main(["--run-dir", str(tmp_path), "--device", "cpu"]) == 2
    log = (tmp_path / "logs" / "specforge_recipe.log").read_text()
    assert "cannot import specforge" in log and "pip install --no-deps specforge==0.2.0" in log
    assert not (tmp_path / "specforge" / "best").exists()


def split_ids(run_dir: Path) -> list[str]:
    return json.loads((run_dir / "checkpoints" / "val_split.json").read_text())["val_ids"]


def test_compare_recipes_prints_the_side_by_side_table(run_dir, trained, stories260k, tmp_path):
    """scripts/lab/compare_recipes.py's bench and table parts on the trained run (the train part is the fixture)."""
    from test_benchmark import bench_prompts

    prompts = bench_prompts(tmp_path)
    out = tmp_path / "compare"
    done = run_script("scripts/lab/compare_recipes.py", "--run-dir", str(run_dir), "--model-path", str(stories260k),
                      "--mt-bench", str(prompts), "--heldout", str(prompts), "--output-dir", str(out), "--parts",
                      "bench", "table", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "8",
                      "--num-prompts", "2", "--jobs", "2", "--decode-workers", "2", env=ONE_THREAD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # 4 tau runs + 2 teacher-forced, two at a time (--jobs 2: their output interleaves, so count, not lines)
    assert done.stdout.count(" 05_benchmark.py --mode ") == 6
    report = json.loads((out / "compare.json").read_text())
    for row in report["sets"]:
        results = {name: json.loads(next((out / f"{name}_{row['set']}").glob("bench_offline_k3_t0_tau_*.json"))
                                    .read_text()) for name in ("ours", "specforge")}
        taus = {name: result["overall"]["tau"] for name, result in results.items()}
        assert (row["ours"], row["specforge"]) == (taus["ours"], taus["specforge"])
        assert row["ratio"] == pytest.approx(taus["ours"] / taus["specforge"], abs=1e-3)
        # The paired bootstrap over the set's prompts: around the ratio, and every prompt counted once.
        low, high = row["ratio_interval_95"]
        assert low <= row["ratio"] <= high
        assert sum(row["prompts_higher_lower_equal"]) == len(results["ours"]["prompts"]) == 2
    sf = json.loads((run_dir / "specforge" / "specforge_results.json").read_text())
    ours = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
    training = report["training"]
    assert (training["ours_s"], training["specforge_s"]) == (ours["wall_time_s"], sf["total_s"])
    assert report["target"]["tau_holds"] == all(r["ratio"] >= 1.05 for r in report["sets"])
    interval_holds = all(r["ratio_interval_95"][0] >= 1.05 for r in report["sets"])
    assert report["target"]["tau_interval_holds"] == interval_holds
    table = (out / "compare.md").read_text()
    assert table in done.stdout and "| mt_bench |" in table and "| training wall time (s) |" in table
    assert "| 95 % interval (paired bootstrap over prompts) | prompts: ours higher / lower |" in table
    for row in report["sets"]:
        (low, high), (higher, lower, _) = row["ratio_interval_95"], row["prompts_higher_lower_equal"]
        assert f"| {row['ratio']:.3f} | {low:.3f} - {high:.3f} | {higher} / {lower}" in table
    assert f"95 % interval's low end >= 1.05 on every set: {'holds' if interval_holds else 'does not hold'}" in table
    assert "stopped early (max_steps)" in table  # the fixture's few steps are no like-for-like comparison
    # Stage 05 ran with the chain setting on every (drafter, set): four result folders.
    settings = [json.loads(next(p.glob("bench_offline_*tau*.json")).read_text())["settings"]
                for p in sorted(out.glob("*_*")) if p.is_dir() and not p.name.endswith("_validation")]
    assert len(settings) == 4 and all((s["num_steps"], s["topk"], s["temperature"], s["decode_workers"]) ==
                                      (3, 1, 0.0, 2) for s in settings)  # --decode-workers passed through
    # Teacher-forced on our validation split, both drafters on the same held-out samples (the recipe put our
    # val_split.json beside its drafter).
    evals = {name: json.loads(next((out / f"{name}_validation").glob("bench_eval_*.json")).read_text())
             for name in ("ours", "specforge")}
    assert all(e["settings"]["split"].startswith("validation split") for e in evals.values())
    assert evals["ours"]["settings"]["samples"] == evals["specforge"]["settings"]["samples"] == len(split_ids(run_dir))
    assert report["validation_sim_accept_len"]["specforge"] == evals["specforge"]["metrics"]["sim_accept_len"]
    assert "| validation split, teacher-forced" in table

    # scripts/lab/quality_table.py tabulates the same reports, found through a lane.json per drafter that names each
    # set's folder (as scripts/lab/run_lanes.py writes it): a row each, with the prompts used, and the teacher-forced
    # scores.
    run = tmp_path / "tabulated"
    for lane in ("ours", "specforge"):
        steps = [{"name": f"bench_{folder.name.removeprefix(lane + '_')}", "output_dir": str(folder),
                  "benchmark": folder.name.removeprefix(lane + "_")}
                 for folder in sorted(out.glob(f"{lane}_*")) if folder.is_dir()]
        write_json_atomic(run / lane / "lane.json", {"lane": {"name": lane}, "steps": steps})
    done = run_script("scripts/lab/quality_table.py", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ours_") or line.startswith("| specforge_")]
    tau_rows = [row for row in rows if "chain (num_steps 3)" in row]
    assert len(tau_rows) == 4 and all("| 2 of 3, sampled (3 turns) |" in row for row in tau_rows), rows
    for row in report["sets"]:
        ours = next(line for line in tau_rows if line.startswith(f"| ours_{row['set']} |"))
        assert f"| {row['ours']:.2f} |" in ours
    assert sum("_validation |" in row for row in rows) == 2

    # --ours: another of our recipes on the same run (gpu_drafter_quality.sh's candidate): its manifest's time.
    other = tmp_path / "other_recipe"
    shutil.copytree(run_dir / "checkpoints", other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "wall_time_s": 2 * manifest["wall_time_s"]}))
    done = run_script("scripts/lab/compare_recipes.py", "--run-dir", str(run_dir), "--model-path", str(stories260k),
                      "--ours", str(other), "--output-dir", str(out), "--parts", "table", env=ONE_THREAD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((out / "compare.json").read_text())["training"]["ours_s"] == 2 * manifest["wall_time_s"]
    missing = run_script("scripts/lab/compare_recipes.py", "--run-dir", str(run_dir), "--model-path", str(stories260k),
                         "--ours", str(tmp_path / "nowhere"), "--mt-bench", str(prompts), "--parts", "bench")
    assert missing.returncode == 2 and f"our drafter (stage 04) not found at {tmp_path / 'nowhere'}" in missing.stderr


def test_a_run_directory_without_hidden_states_is_a_usage_error(tmp_path):
    _need_specforge()
    (tmp_path / "run").mkdir()
    assert _script().main(["--run-dir", str(tmp_path / "run"), "--device", "cpu"]) == 2
    log = (tmp_path / "run" / "logs" / "specforge_recipe.log").read_text()
    assert "no hidden_states/manifest.json; run 02_extract_hidden_states.py on it first" in log


def test_a_full_plan_trains_every_sample_once_per_epoch(run_dir, trained, stories260k):
    """Three samples, two epochs: six steps, each sample twice, and not reported as stopped early."""
    import logging

    from eagle3_pipeline.peer import specforge, specforge_export
    from eagle3_pipeline.peer.specforge_run import drafter_config_for, plan_run, train
    from eagle3_pipeline.verifier.loading import read_embedding_tensors, read_verifier_info

    plan = plan_run(run_dir, run_dir / "checkpoints", {"epochs": 2, "dtype": "float32"}, "cpu")
    plan.train_entries = plan.train_entries[:3]
    sf = specforge.import_specforge("cpu")
    total = sf.resolve_total_steps(total_steps=None, max_steps=None, num_samples=3, batch_size=1,
                                   accumulation_steps=1, num_epochs=2)
    cfg = drafter_config_for(plan, run_dir / "checkpoints", read_verifier_info(str(stories260k)))
    tensors = read_embedding_tensors(str(stories260k))
    recipe = specforge.SpecForgeRecipe(sf, specforge_export.specforge_drafter_config(cfg), tensors["embed_tokens"],
                                       tensors["lm_head"], plan.mapping.d2t, plan.mapping.t2d, plan.settings, total,
                                       "cpu")
    record = train(recipe, plan, 0, logging.getLogger("test"))
    lengths = [min(int(e["num_tokens"]), plan.settings.max_length) for e in plan.train_entries]
    assert (record["steps"], record["planned_steps"], record["epochs_completed"]) == (6, 6, 2)
    assert record["stopped_early"] is None and record["tokens"] == 2 * sum(lengths)
    assert sorted(row["tokens"] for row in record["history"]) == sorted(lengths * 2)


def test_requirements_pin_the_specforge_release_the_recipe_is_written_for():
    import re

    from eagle3_pipeline.peer.specforge import SPECFORGE_VERSION

    requirements = (REPO / "requirements-test.txt").read_text()
    assert re.search(rf"^specforge=={re.escape(SPECFORGE_VERSION)}\s*(;.*)?$", requirements, re.M), requirements
    assert "--no-deps -r requirements-test.txt" in (REPO / "scripts" / "setup_env.sh").read_text()
