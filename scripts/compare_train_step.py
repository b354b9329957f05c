#!/usr/bin/env python3
"""Side-by-side table of stage 04's training step against SpecForge's, from one device session's results.

    python3 scripts/compare_train_step.py DIR
DIR holds what scripts/device_bench_train_step.sh wrote: ours.jsonl (bf16 GEMMs), ours_fp8.jsonl (--fp8) and
peer.jsonl (SpecForge 0.2.0). Prints a Markdown table: tokens/s and peak GiB of each, speed and memory ratios
against the peer, and whether the target (>= 1.3x the peer's tokens/s at <= 0.7x its peak memory) holds.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SPEED_TARGET, MEMORY_TARGET = 1.3, 0.7


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
    ours, fp8, peer = (read(args.dir / name) for name in ("ours.jsonl", "ours_fp8.jsonl", "peer.jsonl"))
    print("| shape, S | SpecForge tok/s, GiB | ours bf16 tok/s, GiB | speed, memory | target | "
          "ours --fp8 tok/s, GiB | speed, memory | target |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(set(ours) | set(fp8) | set(peer), key=lambda k: (["smollm2", "llama8b", "kimi"].index(k[0])
                                                                      if k[0] in ("smollm2", "llama8b", "kimi")
                                                                      else 9, k[1])):
        p = peer.get(key)
        peer_cell = f"{p['tokens_per_s'] / 1e3:.2f}K, {p['peak_mem_gib']:.2f}" if p else "-"
        print(f"| {key[0]} {key[1]} | {peer_cell} | {cell(ours.get(key), p)} | {cell(fp8.get(key), p)} |")


if __name__ == "__main__":
    main()
