#!/usr/bin/env python
"""Check stage 02's SGLang backend on a GPU machine with a checked SGLang release installed (0.5.17 or 0.5.23:
patches/sglang_releases.py; another with --allow-untested-sglang): the same samples through `--backend hf` and
`--backend sglang`, then the stored tensors compared file by file.

    python scripts/check_sglang_capture.py --model-path /models/Llama-3.1-8B-Instruct --tp-size 1
    python scripts/check_sglang_capture.py --model-path /models/small-DeepSeek-V3 --reference float32   # MoE
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

--reference float32 judges verifiers whose bf16 runs are themselves far from exact: in an MoE, bf16 rounding flips
near-tied expert choices, so after the first MoE layer single tokens of two correct bf16 runs differ (down to
cosine ~0.9) and the fixed MIN_COSINE judges noise. The hf backend then also runs in float32 (stage 02 --dtype
float32, stored in float32, into WORK/hf32), and both bf16 runs (sglang, hf) are compared with it. Per file name
(aux_0..2, final), over all tokens of all samples, one JSON line gives SGLang-vs-float32 and transformers-vs-
float32 side by side: the mean cosine, the lowest token cosine and the share of tokens with cosine above
MIN_COSINE (also the summary's `vs_float32`). It passes when for every file name SGLang's bf16 is as close to
float32 as transformers' bf16: its mean cosine at most MEAN_COSINE_TOLERANCE (1e-3) and its share at most
SHARE_TOLERANCE (2 points) below transformers'. Why these: two correct bf16 engines flip different tokens, by
chance and by their kernels. On the random DeepSeek-V3 of make_random_verifier.py the two engines' bf16 runs had
mean cosine 0.998 with each other, so each sits about 1e-3 from float32: the mean may be off by that much again.
The share is a count over ~8,000 tokens (32 samples): were flips independent, two engines with the same flip rate
would differ by chance by under a point; 2 points leaves room for flips that spread along a sequence. A capture
bug goes far beyond both: a wrong layer, a token shifted by one or a missing residual (a layer's update without
the stream) stores another state, whose cosine with the right one is far below MIN_COSINE for nearly every token
(neighbouring layers and tokens are not within bf16 rounding of each other), so the share drops by tens of points
and the mean by 1e-2 or more. tests/test_check_sglang_capture.py shows it on residual-stream-like tensors whose
neighbouring layers still have cosine ~0.9 (share down by 97 points, mean by 0.07 or more). The check is only as
sharp as transformers' bf16 run is close to float32: each file name's line shows how close that is.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]


def prepare(folder: Path, model_path: str, trust_remote_code: bool, count: int, lengths: tuple[int, int],
            seed: int) -> Path:
    from eagle3_pipeline.formats.manifest import Manifest
    from eagle3_pipeline.verifier.loading import read_verifier_info

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


def stage02_command(data: Path, out: Path, args, backend: str, dtype: str = "bfloat16") -> list[str]:
    """The stage-02 command of one run: `backend` computing and storing in `dtype`."""
    command = [sys.executable, str(REPO / "02_extract_hidden_states.py"), "--model-path", args.model_path,
               "--prepared-data", str(data), "--output-dir", str(out), "--backend", backend,
               "--max-seq-len", str(args.max_len), "--dtype", dtype, "--overwrite"]
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
    return command


def run_stage02(data: Path, out: Path, args, backend: str, dtype: str = "bfloat16") -> None:
    command = stage02_command(data, out, args, backend, dtype)
    print(json.dumps({"running": " ".join(command)}), flush=True)
    subprocess.run(command, check=True, cwd=str(REPO))


MIN_COSINE = 0.999  # a file agrees when its tokens' mean cosine similarity between the backends is above this
# --reference: how much further from the float32 run SGLang's bf16 may be than transformers' (the docstring says why)
MEAN_COSINE_TOLERANCE = 1e-3  # on the mean token cosine of a file name
SHARE_TOLERANCE = 0.02  # on the share of tokens with cosine above MIN_COSINE (2 points)
REFERENCES = ("float32",)


def token_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The cosine similarity of each token's row of `a` with the same token's row of `b` (in float32)."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def file_similarity(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How close one stored file of the two backends is: its tokens' mean and lowest cosine, largest difference."""
    cosine = token_cosines(a, b)
    return {"cosine": float(cosine.mean()), "min_token_cosine": float(cosine.min()),
            "max_abs": float((a.float() - b.float()).abs().max())}


def paired_files(folders: Sequence[Path]) -> Iterator[tuple[dict, str, list[torch.Tensor]]]:
    """(the last folder's index entry of the sample, file name, that file's tensor in each folder) for every sample
    and stored file of stage-02 outputs that hold the same samples."""
    from eagle3_pipeline.formats.hidden_states import AUX_FILES, FINAL_FILE, open_hidden_states

    indexes = [open_hidden_states(folder)[1] for folder in folders]
    ids = [[entry["id"] for entry in entries] for entries in indexes]
    assert all(other == ids[0] for other in ids), f"{', '.join(map(str, folders))}: the indexes list other samples"
    for entries in zip(*indexes):
        for name in AUX_FILES + (FINAL_FILE,):
            tensors = [torch.load(folder / entry["path"] / name, weights_only=True)
                       for folder, entry in zip(folders, entries)]
            assert len({t.shape for t in tensors}) == 1, (entries[0]["path"], name, [t.shape for t in tensors])
            yield entries[-1], name, tensors


def compare(hf_dir: Path, sglang_dir: Path) -> dict:
    """Per stored file name (aux_0..2, final): the worst file over all samples; plus the worst file of all."""
    from eagle3_pipeline.formats.hidden_states import AUX_FILES, FINAL_FILE

    worst: dict = {name: {"max_abs": 0.0, "min_cosine": 1.0, "min_token_cosine": 1.0, "worst_file": None}
                   for name in AUX_FILES + (FINAL_FILE,)}
    worst_file: dict = {"cosine": 2.0}
    for sg_entry, name, (a, b) in paired_files([hf_dir, sglang_dir]):
        summary = worst[name]
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


# --- --reference float32: each bf16 run against the float32 run ---------------------------------------------------

def closeness(cosines: Sequence[torch.Tensor]) -> dict:
    """How close a run is to the reference over the token cosines of one file name (all samples)."""
    every = torch.cat(list(cosines))
    return {"mean_cosine": float(every.mean()), "min_token_cosine": float(every.min()),
            "share_above": float((every > MIN_COSINE).float().mean()), "tokens": every.numel()}


def as_close(sglang: dict, hf: dict) -> bool:
    """SGLang's bf16 is as close to the reference as transformers' bf16, within the tolerances."""
    return (sglang["mean_cosine"] >= hf["mean_cosine"] - MEAN_COSINE_TOLERANCE
            and sglang["share_above"] >= hf["share_above"] - SHARE_TOLERANCE)


def compare_to_reference(hf_dir: Path, sglang_dir: Path, reference_dir: Path) -> dict:
    """Per stored file name: the closeness of SGLang's and of transformers' run to the reference run, and whether
    SGLang's is as close (`agrees`)."""
    cosines: dict = {}
    for _, name, (hf, sglang, reference) in paired_files([hf_dir, sglang_dir, reference_dir]):
        runs = cosines.setdefault(name, {"sglang": [], "hf": []})
        runs["sglang"].append(token_cosines(sglang, reference))
        runs["hf"].append(token_cosines(hf, reference))
    result = {}
    for name, runs in cosines.items():
        sglang, hf = closeness(runs["sglang"]), closeness(runs["hf"])
        result[name] = {"sglang": sglang, "hf": hf, "agrees": as_close(sglang, hf)}
    return result


def agrees_with_reference(vs_reference: dict) -> bool:
    return all(entry["agrees"] for entry in vs_reference.values())


def furthest_behind(vs_reference: dict) -> str:
    """The file name where SGLang falls furthest behind transformers (in share above MIN_COSINE, then mean)."""
    def shortfall(name: str) -> tuple[float, float]:
        sglang, hf = vs_reference[name]["sglang"], vs_reference[name]["hf"]
        return hf["share_above"] - sglang["share_above"], hf["mean_cosine"] - sglang["mean_cosine"]

    return max(vs_reference, key=shortfall)


def reference_verdict(vs_reference: dict) -> str:
    """The verdict of the `worst file:` line under --reference float32."""
    name = furthest_behind(vs_reference)
    sglang, hf = vs_reference[name]["sglang"], vs_reference[name]["hf"]
    verdict = "agrees" if agrees_with_reference(vs_reference) else "DOES NOT agree"
    return (f"{verdict} against the float32 reference (each file name needs SGLang's mean cosine at most "
            f"{MEAN_COSINE_TOLERANCE:g} and its share of tokens above {MIN_COSINE} at most "
            f"{SHARE_TOLERANCE * 100:g} points below transformers'; furthest behind: {name}, mean cosine "
            f"{sglang['mean_cosine']:.6f} vs {hf['mean_cosine']:.6f}, above {MIN_COSINE}: "
            f"{sglang['share_above']:.2%} vs {hf['share_above']:.2%})")


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
    parser.add_argument("--reference", choices=REFERENCES,
                        help="judge both bf16 runs against an hf run in this dtype (for MoE verifiers; see above) "
                             f"instead of SGLang against hf by cosine > {MIN_COSINE} (default)")
    parser.add_argument("--work-dir", help="where the runs go (default: a temporary folder, kept)")
    args = parser.parse_args(argv)
    if args.reference and args.skip_hf:
        parser.error(f"--reference {args.reference} is an hf backend run: drop --skip-hf or --reference")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="check_sglang_capture_"))
    data = prepare(work / "data", args.model_path, args.trust_remote_code, args.num_samples,
                   (args.min_len, args.max_len), args.seed)
    run_stage02(data, work / "sglang", args, "sglang")
    from eagle3_pipeline.formats.hidden_states import open_hidden_states

    manifest, entries = open_hidden_states(work / "sglang")
    result = {"model_path": args.model_path, "tp_size": args.tp_size, "samples": len(entries),
              "aux_layers": manifest["aux_layers"], "backend": manifest["backend"], "work_dir": str(work),
              "sglang_run": manifest.get("last_run")}
    if not args.skip_hf:
        run_stage02(data, work / "hf", args, "hf")
        comparison = compare(work / "hf", work / "sglang")
        result["hf_vs_sglang"] = comparison["files"]
        result["worst_file"] = comparison["worst_file"]
        if args.reference:
            run_stage02(data, work / "hf32", args, "hf", args.reference)
            vs_reference = compare_to_reference(work / "hf", work / "sglang", work / "hf32")
            for name, entry in vs_reference.items():
                print(json.dumps({"vs_float32": name, **entry}), flush=True)
            result.update(reference=args.reference, vs_float32=vs_reference,
                          tolerance={"mean_cosine": MEAN_COSINE_TOLERANCE, "share_above": SHARE_TOLERANCE},
                          share_above_cosine=MIN_COSINE, agree=agrees_with_reference(vs_reference))
            verdict = reference_verdict(vs_reference)
        else:
            result["min_cosine_required"] = MIN_COSINE
            result["agree"] = agrees(comparison)
            verdict = (f"{'agrees' if result['agree'] else 'DOES NOT agree'} "
                       f"(every file needs cosine > {MIN_COSINE})")
        worst = comparison["worst_file"]
        print(f"worst file: {worst['file']} (sample {worst['sample']!r}): cosine {worst['cosine']:.6f} "
              f"(lowest token {worst['min_token_cosine']:.6f}), max |diff| {worst['max_abs']:.4g}; {verdict}",
              flush=True)
    print(json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "check_sglang_capture.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("agree", True) else 1


if __name__ == "__main__":
    sys.exit(main())
