#!/usr/bin/env python
"""Check stage 02's SGLang backend on a GPU machine with a checked SGLang release installed (0.5.17 or 0.5.23:
patches/sglang_releases.py; another with --allow-untested-sglang): the same samples through `--backend hf` and
`--backend sglang`, then the stored tensors compared file by file.

    python scripts/check_sglang_capture.py --model-path /models/Llama-3.1-8B-Instruct --tp-size 1
    python scripts/check_sglang_capture.py --model-path /models/some-DeepSeek-V3-family-model --tp-size 8 \\
        --trust-remote-code --skip-hf          # a verifier transformers cannot run: SGLang only, self-checks

Samples are random token sequences of --min-len..--max-len tokens written as a stage-01 output (with the
verifier's identity in its manifest), so nothing is downloaded. For each sample and file it reports the largest
absolute difference and the cosine similarity between the two backends (a file's cosine: the mean over its
tokens; bf16 kernels differ between engines, so equality is not expected). It passes when every file's cosine is
above 0.999 (MIN_COSINE) and prints the worst file. With --skip-hf only the SGLang run and its own checks (files,
shapes, manifest, index) are made. Prints one JSON object per line (and the worst file as a plain line); the last
line is the summary, also written to $OUT/check_sglang_capture.json when $OUT is set; its `sglang_run` names the
SGLang version the run used and the release entry its settings came from (`sglang_version`, `sglang_release`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def prepare(folder: Path, model_path: str, trust_remote_code: bool, count: int, lengths: tuple[int, int],
            seed: int) -> Path:
    from common.formats.manifest import Manifest
    from common.verifier.loading import read_verifier_info

    info = read_verifier_info(model_path, trust_remote_code)
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(count):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator))
        ids = torch.randint(10, info.vocab_size - 10, (length,), generator=generator).tolist()
        records.append({"id": f"check-{i:04d}", "input_ids": ids, "loss_mask": [1] * length})
    (folder / "tokenized_data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = Manifest(folder, "01_prepare_data", {"model_path": model_path})
    manifest.data["verifier"] = info.identity()
    manifest.data["counts"] = {"samples": count, "tokens": sum(len(r["input_ids"]) for r in records),
                               "loss_tokens": sum(len(r["input_ids"]) for r in records)}
    manifest.complete()
    return folder / "tokenized_data.jsonl"


def run_stage02(data: Path, out: Path, args, backend: str) -> None:
    command = [sys.executable, str(REPO / "02_extract_hidden_states.py"), "--model-path", args.model_path,
               "--prepared-data", str(data), "--output-dir", str(out), "--backend", backend,
               "--max-seq-len", str(args.max_len), "--overwrite"]
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    if backend == "sglang":
        command += ["--tp-size", str(args.tp_size), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        for flag, value in (("--attention-backend", args.attention_backend),
                            ("--sampling-backend", args.sampling_backend)):
            command += [flag, value] if value else []
        for setting in args.sglang_arg or ():
            command += ["--sglang-arg", setting]
        if args.allow_untested_sglang:
            command.append("--allow-untested-sglang")
    else:
        command += ["--device", "cuda", "--device-map", "auto"]
    print(json.dumps({"running": " ".join(command)}), flush=True)
    subprocess.run(command, check=True, cwd=str(REPO))


MIN_COSINE = 0.999  # a file agrees when its tokens' mean cosine similarity between the backends is above this


def file_similarity(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How close one stored file of the two backends is: its tokens' mean and lowest cosine, largest difference."""
    a, b = a.float(), b.float()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {"cosine": float(cosine.mean()), "min_token_cosine": float(cosine.min()),
            "max_abs": float((a - b).abs().max())}


def compare(hf_dir: Path, sglang_dir: Path) -> dict:
    """Per stored file name (aux_0..2, final): the worst file over all samples; plus the worst file of all."""
    from common.formats.hidden_states import AUX_FILES, FINAL_FILE, open_hidden_states

    _, hf_entries = open_hidden_states(hf_dir)
    _, sg_entries = open_hidden_states(sglang_dir)
    assert [e["id"] for e in hf_entries] == [e["id"] for e in sg_entries], "the two indexes list other samples"
    worst: dict = {name: {"max_abs": 0.0, "min_cosine": 1.0, "min_token_cosine": 1.0, "worst_file": None}
                   for name in AUX_FILES + (FINAL_FILE,)}
    worst_file: dict = {"cosine": 2.0}
    for hf_entry, sg_entry in zip(hf_entries, sg_entries):
        for name, summary in worst.items():
            a = torch.load(hf_dir / hf_entry["path"] / name, weights_only=True)
            b = torch.load(sglang_dir / sg_entry["path"] / name, weights_only=True)
            assert a.shape == b.shape, (name, a.shape, b.shape)
            found = file_similarity(a, b)
            summary["max_abs"] = max(summary["max_abs"], found["max_abs"])
            summary["min_token_cosine"] = min(summary["min_token_cosine"], found["min_token_cosine"])
            if found["cosine"] < summary["min_cosine"] or summary["worst_file"] is None:
                summary["min_cosine"] = found["cosine"]
                summary["worst_file"] = f"{sg_entry['path']}/{name}"
            if found["cosine"] < worst_file["cosine"]:
                worst_file = {"file": f"{sg_entry['path']}/{name}", "sample": sg_entry["id"], **found}
    return {"files": worst, "worst_file": worst_file}


def agrees(comparison: dict) -> bool:
    """Every file's cosine is above MIN_COSINE (the similarity the docstring promises)."""
    return all(v["min_cosine"] > MIN_COSINE for v in comparison["files"].values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--attention-backend", help="stage 02's --attention-backend for the SGLang run")
    parser.add_argument("--sampling-backend", help="stage 02's --sampling-backend for the SGLang run")
    parser.add_argument("--sglang-arg", action="append", metavar="KEY=VALUE",
                        help="stage 02's --sglang-arg for the SGLang run (repeatable)")
    parser.add_argument("--allow-untested-sglang", action="store_true",
                        help="stage 02's --allow-untested-sglang: check a release the hooks are not checked against")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="SGLang only (a verifier transformers cannot run)")
    parser.add_argument("--work-dir", help="where the runs go (default: a temporary folder, kept)")
    args = parser.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="check_sglang_capture_"))
    data = prepare(work / "data", args.model_path, args.trust_remote_code, args.num_samples,
                   (args.min_len, args.max_len), args.seed)
    run_stage02(data, work / "sglang", args, "sglang")
    from common.formats.hidden_states import open_hidden_states

    manifest, entries = open_hidden_states(work / "sglang")
    result = {"model_path": args.model_path, "tp_size": args.tp_size, "samples": len(entries),
              "aux_layers": manifest["aux_layers"], "backend": manifest["backend"], "work_dir": str(work),
              "sglang_run": manifest.get("last_run")}
    if not args.skip_hf:
        run_stage02(data, work / "hf", args, "hf")
        comparison = compare(work / "hf", work / "sglang")
        result["hf_vs_sglang"] = comparison["files"]
        result["worst_file"] = comparison["worst_file"]
        result["min_cosine_required"] = MIN_COSINE
        result["agree"] = agrees(comparison)
        worst = comparison["worst_file"]
        print(f"worst file: {worst['file']} (sample {worst['sample']!r}): cosine {worst['cosine']:.6f} "
              f"(lowest token {worst['min_token_cosine']:.6f}), max |diff| {worst['max_abs']:.4g}; "
              f"{'agrees' if result['agree'] else 'DOES NOT agree'} (every file needs cosine > {MIN_COSINE})",
              flush=True)
    print(json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "check_sglang_capture.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("agree", True) else 1


if __name__ == "__main__":
    sys.exit(main())
