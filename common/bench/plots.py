"""The PNG of a benchmark report: matplotlib when installed, else a small built-in bar-chart rasteriser."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any, Sequence

from common.formats.files import atomic_path


def _plot_series(results: dict[str, Any]) -> list[tuple[str, list[str], list[float]]]:
    """(title, labels, values) panels: acceptance by draft position, and tau per category if any."""
    panels = []
    if results.get("mode") == "offline":
        rates = results["overall"]["acceptance"]["conditional_rate"]
        panels.append(("acceptance rate by draft position", [str(j + 1) for j in range(len(rates))],
                       [r if r is not None else 0.0 for r in rates]))
        if results.get("categories"):
            names = list(results["categories"])
            panels.append(("tau by category", names,
                           [results["categories"][n]["tau"] or 0.0 for n in names]))
    elif results.get("mode") == "eval":
        accs = results["metrics"].get("acc_per_step", [])
        panels.append(("top-1 agreement by TTT step", [str(j) for j in range(len(accs))], list(accs)))
    elif results.get("mode") == "server":
        rows = [(name, results[name]) for name in ("speculative", "baseline") if results.get(name)]
        panels.append(("output tokens/s", [n for n, _ in rows], [r["output_tokens_per_s"] or 0.0 for _, r in rows]))
    return panels


def write_png(path: str | Path, results: dict[str, Any], log=None) -> Path | None:
    panels = _plot_series(results)
    if not panels:
        return None
    path = Path(path)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if log is not None:
            log.info("matplotlib is not installed: drawing %s with the built-in bar-chart fallback", path.name)
        with atomic_path(path) as tmp:
            tmp.write_bytes(render_bar_png(panels))
        return path
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (title, labels, values) in zip(axes[0], panels):
        axis.bar(range(len(values)), values, color="#3b6ea8")
        axis.set_xticks(range(len(values)))
        axis.set_xticklabels(labels, rotation=30 if max((len(s) for s in labels), default=0) > 3 else 0)
        axis.set_title(title)
        for i, value in enumerate(values):
            axis.annotate(f"{value:.2f}", (i, value), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
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


def render_bar_png(panels: Sequence[tuple[str, Sequence[str], Sequence[float]]], panel_width: int = 420,
                   height: int = 300) -> bytes:
    """Bar charts side by side, each bar labelled with its value (the fallback without matplotlib)."""
    canvas = _Canvas(panel_width * len(panels), height)
    margin, top, bottom = 30, 30, 40
    for index, (_, labels, values) in enumerate(panels):
        left = index * panel_width + margin
        right = (index + 1) * panel_width - margin // 2
        peak = max([v for v in values if v is not None] + [1e-9])
        scale = (height - top - bottom) / peak
        canvas.rect(left, height - bottom, right, height - bottom + 2, (0, 0, 0))  # x axis
        canvas.rect(left, top - 10, left + 2, height - bottom, (0, 0, 0))  # y axis
        slot = (right - left) / max(len(values), 1)
        for i, value in enumerate(values):
            x0 = int(left + i * slot + slot * 0.15)
            x1 = int(left + (i + 1) * slot - slot * 0.15)
            y0 = int(height - bottom - (value or 0.0) * scale)
            canvas.rect(x0, y0, x1, height - bottom, (59, 110, 168))
            canvas.text(x0, max(y0 - 14, 2), f"{(value or 0.0):.2f}")
            canvas.text(x0, height - bottom + 8, str(i + 1) if not labels[i].isdigit() else labels[i])
    return canvas.png()
