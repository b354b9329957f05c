"""Reports a person reads at a glance: labelled plots titled with their setting, undefined acceptance left blank,
stage 04's training curves from metrics.jsonl, the benchmark folder's index of every run, noisy speedups marked."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def offline_results(rates, turns=2, tokens=48, created="2026-01-01T00:00:00Z", speedup=1.5):
    """A results dict shaped as --mode offline writes it (the numbers are the test's own)."""
    overall = {"tau": 1.6, "turns": turns, "verify_steps": 30, "new_tokens": {"spec": tokens, "plain": tokens},
               "tokens_per_s": {"spec": 30.0, "plain": 20.0, "hf": 19.0}, "speedup_vs_plain": speedup,
               "speedup_vs_hf_generate": 1.58, "repetition_4gram_share": 0.1,
               "acceptance": {"conditional_rate": rates, "share": [0.5, 0.2, 0.0][:len(rates)]}}
    return {"mode": "offline", "created_at": created, "overall": overall,
            "settings": {"drafting": "chain", "draft_checkpoint": "best", "prompts": "/x/mt_bench.jsonl",
                         "prompt_count": 2, "num_steps": len(rates), "topk": 1, "temperature": 0.0, "dtype": "bfloat16",
                         "compute_dtype": "float32", "device": "cpu"},
            "categories": {"story": {"turns": turns, "tau": 1.6, "speedup_vs_plain": speedup,
                                     "repetition_4gram_share": 0.1, "new_tokens": {"spec": tokens}}},
            "prompts": [{"id": "1", "category": "story", "summary": {"turns": turns, "new_tokens": {"spec": tokens},
                                                                     "tau": 1.6, "speedup_vs_plain": speedup,
                                                                     "repetition_4gram_share": 0.1}}]}


def test_every_panel_has_axis_labels_and_the_figure_names_its_setting():
    from eagle3_pipeline.bench.plots import build_figure

    fig = build_figure(offline_results([0.5, 0.25, None]))
    assert "drafter best" in fig._suptitle.get_text() and "prompts mt_bench.jsonl" in fig._suptitle.get_text()
    assert "k=3" in fig._suptitle.get_text() and "T=0.0" in fig._suptitle.get_text()
    assert "tau 1.60" in fig._suptitle.get_text()
    position, category = fig.axes
    for axis in fig.axes:
        assert axis.get_xlabel() and axis.get_ylabel() and axis.get_title()
    assert "conditional" in position.get_title() and "conditional" in position.get_ylabel()
    # The third position was never reached: no bar there (not a bar of height 0), yet its tick stays.
    heights = [bar.get_height() for bar in position.patches]
    assert heights == [0.5, 0.25] and [t.get_text() for t in position.get_xticklabels()] == ["1", "2", "3"]
    assert category.get_xlabel() == "prompt category"


def test_the_fallback_png_leaves_undefined_positions_blank():
    from eagle3_pipeline.bench.plots import render_bar_png

    blank = render_bar_png([("a", ["1", "2"], [0.5, None])])
    zero = render_bar_png([("a", ["1", "2"], [0.5, 0.0])])
    assert blank != zero  # 0.0 prints "0.00" over its slot; None prints nothing


def test_stage_04_curves_are_drawn_from_metrics_jsonl(tmp_path):
    from eagle3_pipeline.train.plots import build_training_figure, write_training_curves

    metrics = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": s, "epoch": 0, "loss": 3.0 - 0.1 * s, "sim_accept_len": 1.1 + 0.05 * s,
              "acc_per_step": [0.2 + 0.01 * s, 0.1]} for s in (5, 10, 15)]
    lines.insert(2, {"kind": "eval", "step": 10, "epoch": 0, "loss": 2.5, "sim_accept_len": 1.4,
                     "acc_per_step": [0.3, 0.2]})
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "tra')  # torn last line
    fig = build_training_figure(metrics, "stage 04 training: run r")
    assert fig._suptitle.get_text() == "stage 04 training: run r"
    loss, tau, top1 = fig.axes
    for axis in fig.axes:
        assert axis.get_xlabel() == "optimizer step" and axis.get_ylabel() and axis.get_title()
    train, val = loss.get_lines()
    assert list(train.get_xdata()) == [5, 10, 15] and list(val.get_xdata()) == [10]
    assert list(tau.get_lines()[1].get_ydata()) == [1.4]
    assert list(top1.get_lines()[0].get_ydata()) == pytest.approx([0.25, 0.3, 0.35])
    png = write_training_curves(metrics, tmp_path / "curves.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_training_curves(tmp_path / "absent.jsonl", tmp_path / "none.png", "t") is None


def test_the_index_lists_every_run_newest_first_and_marks_noisy_speedups(tmp_path):
    from eagle3_pipeline.bench.report import write_index, write_reports

    write_reports(tmp_path, "bench_offline_k3_t0", offline_results([0.5, 0.25, None]))
    write_reports(tmp_path, "bench_offline_k2_t0", offline_results(
        [0.6, 0.3], turns=10, tokens=2000, created="2026-01-02T00:00:00Z", speedup=1.25))
    index = (tmp_path / "README.md").read_text()
    newer, older = index.index("bench_offline_k2_t0"), index.index("bench_offline_k3_t0")
    assert newer < older  # newest first
    assert "1.500 (noisy)" in index and "1.250 |" in index and "1.250 (noisy)" not in index
    assert "| float32 |" in index and "mt_bench.jsonl (2)" in index
    markdown = (tmp_path / "bench_offline_k3_t0.md").read_text()
    assert "Computed in **float32** on cpu (--dtype bfloat16 applies on a GPU" in markdown
    assert "Speedups noisy: 2 turns, 48 new tokens" in markdown
    per_prompt = markdown.split("## Per prompt")[1]
    assert "speedup" not in per_prompt.split("\n|")[1]  # the per-prompt table has no speedup column
    steady = (tmp_path / "bench_offline_k2_t0.md").read_text()
    assert "Speedups noisy" not in steady
    # A report that cannot be read (being replaced) is left out, not a failure.
    (tmp_path / "bench_broken.json").write_text("{")
    assert write_index(tmp_path).read_text().count("](bench_offline_") == 2


@pytest.mark.parametrize("mode", ["server", "eval"])
def test_other_modes_get_labelled_plots_too(mode):
    from eagle3_pipeline.bench.plots import build_figure

    results = {"mode": mode, "settings": {"draft_checkpoint": "best", "temperature": 0.0, "concurrency": 2,
                                          "num_steps": 3},
               "speculative": {"output_tokens_per_s": 50.0, "accept_length": 2.1},
               "baseline": {"output_tokens_per_s": None}, "metrics": {"acc_per_step": [0.6, 0.4], "sim_accept_len": 1.9}}
    fig = build_figure(results)
    [axis] = fig.axes
    assert axis.get_xlabel() and axis.get_ylabel() and fig._suptitle.get_text().startswith(f"stage 05 {mode}")
    if mode == "server":
        assert [bar.get_height() for bar in axis.patches] == [50.0]  # the baseline's missing figure is blank
