"""The PNG of a benchmark report: matplotlib when installed, else a small built-in bar-chart rasteriser.

Every matplotlib panel has axis labels, and the figure's title names the setting (drafter, prompts, k/topk, T, tau).
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from eagle3_pipeline.figures import figures_text
from eagle3_pipeline.formats.files import atomic_path


class Panel(NamedTuple):
    """One bar chart: its title, x tick labels and values (None: undefined there, drawn as no bar), axis labels."""
    title: str
    labels: list[str]
    values: list[float | None]
    xlabel: str = ""
    ylabel: str = ""


def setting_title(results: dict[str, Any]) -> str:
    """The figure's title: what was measured, with which drafter, prompts and decoding settings, and its tau."""
    settings = results.get("settings", {})
    mode = results.get("mode")
    drafter = settings.get("draft_checkpoint") or (Path(settings["draft_model_path"]).name
                                                   if settings.get("draft_model_path") else None)
    prompts = settings.get("prompts")
    parts = [f"drafter {drafter}" if drafter else None,
             f"prompts {Path(str(prompts)).name}" if prompts else None]
    if mode == "offline":
        k = f"k={settings.get('num_steps')}"
        if (settings.get("topk") or 1) > 1:
            k += f", topk={settings['topk']} ({settings.get('num_draft_tokens')} tokens)"
        parts += [k, f"T={settings.get('temperature')}"]
        tau = results.get("overall", {}).get("tau")
        parts.append(f"tau {tau:.2f}" if isinstance(tau, (int, float)) else None)
    elif mode == "server":
        parts += [f"T={settings.get('temperature')}", f"concurrency {settings.get('concurrency')}"]
        tau = (results.get("speculative") or {}).get("accept_length")
        parts.append(f"accept length {tau:.2f}" if isinstance(tau, (int, float)) else None)
    elif mode == "eval":
        parts.append(f"TTT steps {settings.get('num_steps')}")
        parts.append(figures_text(results.get("metrics", {}), digits=2) or None)
    return f"stage 05 {mode}: " + ", ".join(p for p in parts if p)


def _plot_series(results: dict[str, Any]) -> list[Panel]:
    """The panels of a report: acceptance by draft position and tau per category (offline), top-1 agreement by
    TTT step (eval), output tokens/s (server)."""
    panels = []
    if results.get("mode") == "offline":
        rates = results["overall"]["acceptance"]["conditional_rate"]
        panels.append(Panel("conditional acceptance by draft position\n(given every earlier position accepted; "
                            "blank: never reached)", [str(j + 1) for j in range(len(rates))], list(rates),
                            "draft position", "conditional acceptance rate"))
        if results.get("categories"):
            names = list(results["categories"])
            panels.append(Panel("tau by prompt category", names, [results["categories"][n]["tau"] for n in names],
                                "prompt category", "tau (tokens per verify step)"))
    elif results.get("mode") == "eval":
        accs = results["metrics"].get("acc_per_step", [])
        panels.append(Panel("top-1 agreement by TTT step (teacher-forced)", [str(j) for j in range(len(accs))],
                            list(accs), "TTT step", "top-1 agreement with the verifier"))
    elif results.get("mode") == "server":
        rows = [(name, results[name]) for name in ("speculative", "baseline") if results.get(name)]
        panels.append(Panel("output tokens/s", [n for n, _ in rows], [r["output_tokens_per_s"] for _, r in rows],
                            "server", "output tokens/s"))
    return panels


def build_figure(results: dict[str, Any]):
    """The report's matplotlib figure (None when there is nothing to plot): bars with their values, axis labels,
    and the setting as the title; an undefined value (None) is left blank, not drawn as 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _plot_series(results)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
    for axis, panel in zip(axes[0], panels):
        shown = [(i, v) for i, v in enumerate(panel.values) if v is not None]
        axis.bar([i for i, _ in shown], [v for _, v in shown], color="#3b6ea8")
        axis.set_xticks(range(len(panel.values)))
        axis.set_xticklabels(panel.labels, rotation=30 if max((len(s) for s in panel.labels), default=0) > 3 else 0)
        axis.set_xlim(-0.6, len(panel.values) - 0.4)
        axis.set_title(panel.title, fontsize=10)
        axis.set_xlabel(panel.xlabel)
        axis.set_ylabel(panel.ylabel)
        for i, value in shown:
            axis.annotate(f"{value:.2f}", (i, value), ha="center", va="bottom", fontsize=8)
    fig.suptitle(setting_title(results), fontsize=10)
    fig.tight_layout()
    return fig


def write_png(path: str | Path, results: dict[str, Any], log=None) -> Path | None:
    panels = _plot_series(results)
    if not panels:
        return None
    path = Path(path)
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        if log is not None:
            log.info("matplotlib is not installed: drawing %s with the built-in bar-chart fallback", path.name)
        with atomic_path(path) as tmp:
            tmp.write_bytes(render_bar_png(panels))
        return path
    fig = build_figure(results)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path


# A 3x5 pixel font for the digits and '.', enough to print the value on each bar.
_GLYPHS = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"),
}


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, text: str, scale: int = 2, color=(0, 0, 0)) -> None:
        for char in text:
            glyph = _GLYPHS.get(char)
            if glyph is not None:
                for gy, line in enumerate(glyph):
                    for gx, bit in enumerate(line):
                        if bit == "1":
                            self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale, y + (gy + 1) * scale, color)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def render_bar_png(panels: Sequence[Sequence], panel_width: int = 420, height: int = 300) -> bytes:
    """Bar charts side by side, each bar labelled with its value (the fallback without matplotlib; digits only,
    so no titles). Panels are (title, labels, values, ...); a None value is left blank."""
    canvas = _Canvas(panel_width * len(panels), height)
    margin, top, bottom = 30, 30, 40
    for index, panel in enumerate(panels):
        labels, values = panel[1], panel[2]
        left = index * panel_width + margin
        right = (index + 1) * panel_width - margin // 2
        peak = max([v for v in values if v is not None] + [1e-9])
        scale = (height - top - bottom) / peak
        canvas.rect(left, height - bottom, right, height - bottom + 2, (0, 0, 0))  # x axis
        canvas.rect(left, top - 10, left + 2, height - bottom, (0, 0, 0))  # y axis
        slot = (right - left) / max(len(values), 1)
        for i, value in enumerate(values):
            if value is None:
                continue
            x0 = int(left + i * slot + slot * 0.15)
            x1 = int(left + (i + 1) * slot - slot * 0.15)
            y0 = int(height - bottom - (value or 0.0) * scale)
            canvas.rect(x0, y0, x1, height - bottom, (59, 110, 168))
            canvas.text(x0, max(y0 - 14, 2), f"{(value or 0.0):.2f}")
            canvas.text(x0, height - bottom + 8, str(i + 1) if not labels[i].isdigit() else labels[i])
    return canvas.png()
