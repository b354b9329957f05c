"""scripts/lab/scaling_curve.py, the tau-against-data table and plot, on points the real stages made on CPU.

Each point is laid out as scripts/lab/device_data_engine.sh lays out its work folder: stage 01 on chat
conversations for stories260K (the smaller point also with conversations the verifier made, --synthesize), stage
03, stage 04 --online, and for the smaller point stage 05 --tau-only into run/bench_mtbench (T=0) and
run/bench_mtbench_t1 (T=1); the larger point has no benchmark folder, as a run cut short before its eval part.
Every expected figure is read from the same files here, never written down.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from conftest import STORIES_TEMPLATE, TWO_TURN_PROMPTS, run_script
from test_train import _load_module, train_argv

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SCRIPT = "scripts/lab/scaling_curve.py"
THINGS = ["ball", "dog", "tree", "car", "cake", "boat", "cat", "sun"]


def make_point(folder: Path, model: Path, conversations: int, synthesize: int, bench: bool) -> Path:
    """A work folder with run/ made by the real stages 01, 03, 04 --online and (bench) 05."""
    folder.mkdir(parents=True)
    template = folder / "stories.jinja"
    template.write_text(STORIES_TEMPLATE)
    chats = folder / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me a story about the {THINGS[i % 8]} ({i})."},
        {"from": "gpt", "value": f"Once upon a time there was a little girl who had a {THINGS[i % 8]}."}]}) + "\n"
        for i in range(conversations)))
    run = folder / "run"
    flags = ["--run-dir", str(run), "--model-path", str(model), "--dataset", str(chats), "--chat-template",
             str(template), "--eval-ratio", "0.1", "--device", "cpu", "--dtype", "float32"]
    if synthesize:  # made turns need replies from the verifier: --regenerate, short ones
        flags += ["--synthesize", str(synthesize), "--synthesize-max-tokens", "24", "--regenerate",
                  "--max-new-tokens", "24", "--batch-size", "8", "--max-seq-len", "256"]
    assert _load_module("stage01_scaling", "01_prepare_data.py").main(flags) == 0
    assert _load_module("stage03_scaling", "03_build_vocab_mapping.py").main(
        ["--run-dir", str(run), "--model-path", str(model), "--draft-vocab-size", "256"]) == 0
    assert _load_module("stage04_scaling", "04_train.py").main(train_argv(
        run, run / "checkpoints", model, online=True, prepared_data=run / "data" / "tokenized_data.jsonl",
        data_dir=None, epochs=2, eval_interval=4, log_interval=1)) == 0
    if bench:
        stage05 = _load_module("stage05_scaling", "05_benchmark.py")
        for name, temperature in (("mtbench", "0"), ("mtbench_t1", "1")):
            assert stage05.main(["--mode", "offline", "--model-path", str(model), "--draft-model-path",
                                 str(run / "checkpoints" / "best"), "--prompts", str(TWO_TURN_PROMPTS),
                                 "--num-prompts", "4", "--max-new-tokens", "16", "--temperature", temperature,
                                 "--device", "cpu", "--dtype", "float32", "--output-dir", str(run / f"bench_{name}"),
                                 "--tau-only"]) == 0
    return folder


@pytest.fixture(scope="module")
def points(stories260k, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("scaling")
    return (make_point(root / "small", stories260k, 16, synthesize=4, bench=True),
            make_point(root / "large", stories260k, 48, synthesize=0, bench=False))


@pytest.fixture(scope="module")
def curve_module():
    return _load_module("scaling_curve", SCRIPT)


def table_rows(page: str) -> list[list[str]]:
    lines = [line for line in page.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def expected_figures(point: Path) -> dict:
    """The figures of a point as the brief defines them, read here from its files."""
    manifest = json.loads((point / "run" / "data" / "manifest.json").read_text())
    best = json.loads((point / "run" / "checkpoints" / "best.json").read_text())
    lines = [json.loads(line) for line in (point / "run" / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    last_eval = [r for r in lines if r["kind"] == "eval"][-1]
    end = train[-1]["step"]
    window = [r["sim_accept_len"] for r in train if r["step"] > end - max(1, math.ceil(0.05 * end))]
    train_ttt = sum(window) / len(window)
    benches = {}
    for name in ("mtbench", "mtbench_t1", "heldout", "specbench"):
        found = sorted((point / "run" / f"bench_{name}").glob("bench_offline_*.json"))
        benches[name] = json.loads(found[-1].read_text()) if found else None
    made = (manifest.get("synthesis") or {}).get("made", 0)
    return {"conversations": manifest["counts"]["conversations"], "made": made,
            "loss_tokens": manifest["counts"]["loss_tokens"], "epochs": best["run_config"]["epochs"],
            "steps": best["total_steps"], "val_tau": last_eval["sim_chain_tau"],
            "val_ttt": last_eval["sim_accept_len"],
            "train_ttt": train_ttt, "gap": 100 * (train_ttt - last_eval["sim_accept_len"]) / last_eval["sim_accept_len"],
            "benches": benches}


def test_the_table_plot_and_json_of_two_points(points, curve_module, tmp_path):
    small, large = points
    out = tmp_path / "curve"
    done = run_script(SCRIPT, str(large), str(small), "--out", str(out), "--label", f"{small}=few")
    assert done.returncode == 0, done.stderr[-3000:]
    page = (out / "scaling_curve.md").read_text()
    assert page in done.stdout
    rows = table_rows(page)
    expected = [expected_figures(small), expected_figures(large)]
    assert expected[0]["conversations"] < expected[1]["conversations"]
    assert [row[0] for row in rows] == ["few", "large"]  # sorted by training conversations, --label applied
    assert expected[0]["made"] == 4 and expected[1]["made"] == 0  # the synthesized ones, and none
    for row, want in zip(rows, expected):
        assert row[1:6] == [f"{want['conversations']:,}", f"{want['made']:,}", f"{want['loss_tokens']:,}",
                            str(want["epochs"]), f"{want['steps']:,}"]
        assert row[6:9] == [f"{want['val_tau']:.3f} / {want['val_ttt']:.3f}", f"{want['train_ttt']:.3f}",
                            f"{want['gap']:+.1f}"]
        assert row[9:] == [f"{want['benches'][name]['overall']['tau']:.3f}" if want["benches"][name] else "-"
                           for name in ("mtbench", "mtbench_t1", "heldout", "specbench")]
    assert rows[0][11:] == ["-", "-"] and rows[1][9:] == ["-"] * 4
    # The header says what each benchmark measured, from its report's settings.
    report = expected[0]["benches"]["mtbench_t1"]
    assert (f"MT-bench T=1: chain 3-1-4, T=1, 16 new tokens a turn, {report['prompt_selection']['chosen']} of "
            f"{report['prompt_selection']['available']} prompts ({report['overall']['turns']} turns) of "
            f"{TWO_TURN_PROMPTS.name}, on {report['settings']['device']} in {report['settings']['compute_dtype']}") \
        in page
    assert "held-out: no report; Spec-Bench: no report" in page

    curve = json.loads((out / "scaling_curve.json").read_text())
    assert [p["point"] for p in curve["points"]] == ["few", "large"]
    first = curve["points"][0]
    assert first["val_walked_tau"] == expected[0]["val_tau"] and first["train_ttt"] == pytest.approx(
        expected[0]["train_ttt"]) and first["benchmarks"]["mtbench"]["tau"] == \
        expected[0]["benches"]["mtbench"]["overall"]["tau"]
    assert curve_module.markdown(curve) == page  # the JSON holds everything the table shows

    png = (out / "scaling_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1320, 540)  # 11 x 4.5 inches at 120 dpi
    assert len(png) > 20_000  # two panels of lines and labels, not a blank canvas


def test_a_point_cut_short_shows_dashes(points, curve_module, tmp_path, capsys):
    """A torn manifest, no best.json and half the metric lines: "-" where a figure is missing, never a failure."""
    small, _ = points
    cut = tmp_path / "cut"
    (cut / "run" / "data").mkdir(parents=True)
    (cut / "run" / "data" / "manifest.json").write_text('{"counts": {"conver')
    (cut / "run" / "checkpoints").mkdir()
    lines = (small / "run" / "checkpoints" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (cut / "run" / "checkpoints" / "metrics.jsonl").write_text("".join(lines[:len(lines) // 2]))
    assert curve_module.main([str(cut), str(small), "--out", str(tmp_path / "out")]) == 0
    rows = table_rows((tmp_path / "out" / "scaling_curve.md").read_text())
    assert [row[0] for row in rows] == ["small", "cut"]  # no manifest: last
    assert rows[1][1:4] == ["-", "-", "-"] and rows[1][9:] == ["-"] * 4
    assert rows[1][6] != "- / -" and rows[1][7] != "-"  # the metric lines it has are read
    assert "manifest.json: unreadable" in capsys.readouterr().err
    assert (tmp_path / "out" / "scaling_curve.png").stat().st_size > 10_000


def test_a_missing_point_folder_exits_2_naming_it(points, tmp_path):
    small, _ = points
    missing = tmp_path / "no_such_point"
    done = run_script(SCRIPT, str(small), str(missing), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and str(missing) in done.stderr
    assert not (tmp_path / "out").exists()
    inner = run_script(SCRIPT, str(small / "run"), "--out", str(tmp_path / "out"))  # WORK/run for WORK
    assert inner.returncode == 2 and "no run/ in it" in inner.stderr
    label = run_script(SCRIPT, str(small), "--out", str(tmp_path / "out"), "--label", f"{missing}=x")
    assert label.returncode == 2 and str(missing) in label.stderr
    shown = run_script(SCRIPT, "--help")
    assert shown.returncode == 0 and "POINT_DIR" in shown.stdout and "--label" in shown.stdout
