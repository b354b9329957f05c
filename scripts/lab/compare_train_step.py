#!/usr/bin/env python3
"""Side-by-side table of stage 04's training step against SpecForge's, from one device session's results.

    python3 scripts/lab/compare_train_step.py DIR
DIR holds what scripts/lab/device_bench_train_step.sh wrote: peer.jsonl (SpecForge 0.2.0) and any of ours.jsonl
(bf16 GEMMs), ours_fp8.jsonl (--fp8), ours_best.jsonl (each point in its faster mode), ours_fused.jsonl and
ours_fused_fp8.jsonl (--fuse-elementwise). Prints a Markdown table: tokens/s and peak GiB of each, speed and
memory ratios against the peer, and whether the target (>= 1.3x the peer's tokens/s at <= 0.7x its peak
memory) holds.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SPEED_TARGET, MEMORY_TARGET = 1.3, 0.7
VARIANTS = {"ours.jsonl": "ours, bf16", "ours_fp8.jsonl": "ours --fp8", "ours_best.jsonl": "ours, faster mode",
            "ours_fused.jsonl": "ours --fuse-elementwise",
            "ours_fused_fp8.jsonl": "ours --fuse-elementwise --fp8"}
SHAPES = ("smollm2", "llama8b", "kimi")


def read(path: Path) -> dict[tuple[str, int], dict]:
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("status") == "ok":
                    rows[(rec["shape"], int(rec["seq_len"]))] = rec
    return rows


def cell(rec: dict | None, peer: dict | None) -> str:
    if rec is None:
        return "- | - | -"
    tps, mem = rec["tokens_per_s"], rec["peak_mem_gib"]
    if peer is None:
        return f"{tps / 1e3:.2f}K, {mem:.2f} | - | -"
    speed, memory = tps / peer["tokens_per_s"], mem / peer["peak_mem_gib"]
    ok = "yes" if speed >= SPEED_TARGET and memory <= MEMORY_TARGET else "**no**"
    return f"{tps / 1e3:.2f}K, {mem:.2f} | {speed:.2f}x, {memory:.2f} | {ok}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=Path)
    args = parser.parse_args()
    peer = read(args.dir / "peer.jsonl")
    variants = {label: read(args.dir / name) for name, label in VARIANTS.items() if (args.dir / name).exists()}
    header = "| shape, S | SpecForge tok/s, GiB |" + "".join(f" {label} tok/s, GiB | speed, memory | target |"
                                                         for label in variants)
    print(header)
    print("|---" * (2 + 3 * len(variants)) + "|")
    keys = set(peer).union(*variants.values())
    for key in sorted(keys, key=lambda k: (SHAPES.index(k[0]) if k[0] in SHAPES else len(SHAPES), k[1])):
        p = peer.get(key)
        peer_cell = f"{p['tokens_per_s'] / 1e3:.2f}K, {p['peak_mem_gib']:.2f}" if p else "-"
        cells = "".join(f" {cell(rows.get(key), p)} |" for rows in variants.values())
        print(f"| {key[0]} {key[1]} | {peer_cell} |{cells}")


if __name__ == "__main__":
    main()
