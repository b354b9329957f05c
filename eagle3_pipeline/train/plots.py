"""Stage 04's training curves: loss and acceptance by optimizer step, drawn from metrics.jsonl with matplotlib.

The PNG (`training_curves.png` beside the checkpoints) is redrawn when a run ends or stops, so a person sees
how training went without TensorBoard. A metrics line being written (a torn last line) is skipped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.figures import TTT_ESTIMATE, WALKED_CHAIN_TAU
from eagle3_pipeline.formats.files import atomic_path

CURVES_FILE = "training_curves.png"


def read_metrics(path: Path) -> dict[str, list[dict[str, Any]]]:
    """metrics.jsonl's lines by kind ("train", "eval"), in step order; unreadable lines are left out."""
    kinds: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") in kinds and isinstance(record.get("step"), int):
            kinds[record["kind"]].append(record)
    for records in kinds.values():
        records.sort(key=lambda r: r["step"])
    return kinds


def _series(records: list[dict[str, Any]], value) -> tuple[list[int], list[float]]:
    points = [(r["step"], value(r)) for r in records]
    points = [(s, v) for s, v in points if isinstance(v, (int, float)) and v == v]  # drop missing and NaN
    return [s for s, _ in points], [v for _, v in points]


def build_training_figure(metrics_path: Path, title: str):
    """Three panels over optimizer steps: the loss, the TTT acceptance estimate (with validation's walked
    chain tau), and the top-1 agreement at TTT step 0; training lines and validation points. None when
    metrics.jsonl has no line yet."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = read_metrics(metrics_path)
    if not kinds["train"] and not kinds["eval"]:
        return None
    # (title, y label, value, key of a second validation series or None)
    panels = [
        ("loss (decay-weighted over TTT steps)", "loss", lambda r: r.get("loss"), None),
        (f"{TTT_ESTIMATE}, and validation's {WALKED_CHAIN_TAU}", "tokens per verify step",
         lambda r: r.get("sim_accept_len"), "sim_chain_tau"),  # the walk: what SGLang's default chain gets
        ("top-1 agreement at TTT step 0", "share of positions", lambda r: (r.get("acc_per_step") or [None])[0],
         None),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2), squeeze=False)
    for axis, (name, ylabel, value, second) in zip(axes[0], panels):
        steps, values = _series(kinds["train"], value)
        if steps:
            axis.plot(steps, values, color="#3b6ea8", label="training (mean since the last line)")
        steps, values = _series(kinds["eval"], value)
        if steps:
            axis.plot(steps, values, "o-", color="#c8553d", label="validation")
        if second is not None:
            steps, values = _series(kinds["eval"], lambda r: r.get(second))
            if steps:
                axis.plot(steps, values, "s--", color="#4c9a52",
                          label=f"validation, {WALKED_CHAIN_TAU} (compare with stage 05's tau)")
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def training_title(args) -> str:
    """The setting the curves belong to: the run, the verifier, and the training flags that shape them."""
    run = Path(args.run_dir).name if getattr(args, "run_dir", None) else Path(args.output_dir).name
    verifier = Path(str(args.model_path)).name if args.model_path else "?"
    return (f"stage 04 training: run {run}, verifier {verifier}, lr {args.lr:g} ({args.scheduler}), "
            f"{args.epochs} epochs, TTT {args.ttt_steps} steps (decay {args.ttt_decay:g}), loss {args.loss}")


def remove_stale_drawings(png_path: Path) -> list[Path]:
    """The temporary files of drawings a killed run left (`.training_curves.png.*.tmp`), removed at the start of a
    run; the caller holds the output folder's lock, so none belongs to a live run. Returns what was removed."""
    png_path = Path(png_path)
    stale = sorted(png_path.parent.glob(f".{png_path.name}.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def write_training_curves(metrics_path: Path, png_path: Path, title: str, log=None) -> Path | None:
    """Draw the curves into png_path (atomically); None, with a log line, when there is nothing to draw or
    matplotlib is not installed (the numbers stay in metrics.jsonl)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        if log is not None:
            log.info("matplotlib is not installed: no %s (the numbers are in %s)", png_path.name, metrics_path)
        return None
    if not Path(metrics_path).exists():
        return None
    try:
        fig = build_training_figure(metrics_path, title)
        if fig is None:
            return None
        with atomic_path(png_path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
    except Exception as err:  # noqa: BLE001 - a plot never fails (or hides the failure of) a training run
        if log is not None:
            log.warning("could not draw %s (%s: %s); the numbers are in %s", png_path.name, type(err).__name__,
                        err, metrics_path)
        return None
    if log is not None:
        log.info("training curves (loss, acceptance by step): %s", png_path)
    return Path(png_path)
