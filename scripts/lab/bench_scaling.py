#!/usr/bin/env python
"""Scaling of stages 02 and 04 from 1 to N GPUs under torchrun, on the same data: tokens/s and their ratio.

It builds one run directory (a verifier, tokenized data in stage 01's format, the real stage 03), then runs
the real stage scripts through `python -m torch.distributed.run --standalone --nproc_per_node G` for each G
in --gpus (default 1,2):
  stage 02  extraction into a fresh folder per G; tokens/s = tokens written / the slowest rank's extraction
            time (the manifest's last_run; model loading excluded), and the wall time of the whole command;
  stage 04  one epoch on the hidden states of the first G, with the same global batch for every G
            (--grad-accum = --global-accum / G); tokens/s from metrics.jsonl over the training windows after
            the first (which holds torch.compile and warm-up); DDP, plus FSDP with --fsdp; with --online also
            stage 04 --online (each rank runs its own verifier on its batches) on the same prepared data, and
            its tokens/s against the offline run's of the same G (the same batches), with both peak memories.

    python scripts/lab/bench_scaling.py --random-llama 8b                     # 2 GPUs: 8B-shaped random verifier
    python scripts/lab/bench_scaling.py --model-path /models/Llama-3.1-8B-Instruct --gpus 1,2,4
    python scripts/lab/bench_scaling.py --random-llama 8b --gpus 1 --online --ttt-steps 3   # online against offline
    python scripts/lab/bench_scaling.py --device cpu --random-llama tiny --num-samples 24 \\
        --min-len 32 --max-len 96 --max-tokens-per-batch 512      # CPU smoke run (gloo, 2 processes)

The random verifier is written once into --work-dir (weights drawn on the device, saved as safetensors;
it has no tokenizer, which no stage after 01 needs). Needs no network and no `datasets` package. Prints one
JSON object per run and a last line with everything, also written to $OUT/bench_scaling.json when OUT is
set. The stages' own logs stay in --work-dir (RUN/logs); a failing run prints the tail of its output.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SHAPES = {  # Llama shapes for --random-llama (vocabulary and widths as the real models)
    "tiny": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=4096),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
}
# Kept set on the GPU machines (NVLink multicast must stay off there), also for the processes started here.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", help="the verifier: a Hugging Face folder with safetensors")
    source.add_argument("--random-llama", choices=sorted(SHAPES), help="a randomly initialised Llama of this shape")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpus", default="1,2", help="process counts to compare (one GPU each on cuda)")
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64, help="stage 02's --batch-size")
    parser.add_argument("--extract-tokens-per-batch", type=int, default=65536,
                        help="stage 02's --max-tokens-per-batch")
    parser.add_argument("--num-workers", type=int, default=8, help="stage 02's writer processes per rank")
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384, help="stage 04's micro-batch")
    parser.add_argument("--global-accum", type=int, default=0,
                        help="micro-batches per optimizer step over all ranks (default: the largest G)")
    parser.add_argument("--min-steps", type=int, default=None,
                        help="stage 04's --min-steps (default: the stage's; 0 keeps whole micro-batches on small data)")
    parser.add_argument("--draft-vocab-size", type=int, default=32000)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--log-interval", type=int, default=2, help="stage 04's metrics window, in steps")
    parser.add_argument("--fsdp", action="store_true", help="also time stage 04 with --fsdp for each G > 1")
    parser.add_argument("--online", action="store_true",
                        help="also time stage 04 --online for each G, against the offline run of the same G")
    parser.add_argument("--skip-02", action="store_true",
                        help="time stage 04 only (extracts on G=1 unless --work-dir already holds that)")
    parser.add_argument("--work-dir", default=None, help="scratch folder (default: a new one under the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep every extracted folder (default: only G=1's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def note(message: str) -> None:
    print(f"[bench_scaling] {message}", file=sys.stderr, flush=True)


# --- inputs ---------------------------------------------------------------------------------------------

def random_llama(shape: str, folder: Path, device: str) -> Path:
    """A Llama of SHAPES[shape] with random weights (drawn on `device`), saved as a Hugging Face folder."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    config = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, tie_word_embeddings=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device), no_init_weights():
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.fill_(1.0)  # norms
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    os.replace(staging, folder)
    return folder


def write_prepared_data(run: Path, model_path: str, args) -> Path:
    """Stage 01's output without stage 01: random token ids, loss on the last three quarters of each sample.
    Kept when --work-dir already holds it for the same settings (so a later call can reuse its stage 02)."""
    import torch
    from eagle3_pipeline.formats.manifest import Manifest
    from eagle3_pipeline.verifier.loading import read_verifier_info

    data_dir = run / "data"
    key = {"model": model_path, "num_samples": args.num_samples, "min_len": args.min_len, "max_len": args.max_len,
           "seed": args.seed}
    manifest_path = data_dir / "manifest.json"
    if manifest_path.exists():
        existing = json.loads(manifest_path.read_text())
        if existing.get("status") == "complete" and existing.get("bench_data") == key:
            return data_dir / "tokenized_data.jsonl"
    for stale in run.glob("hidden_states_*"):  # extracted from other data
        shutil.rmtree(stale)
    data_dir.mkdir(parents=True, exist_ok=True)
    info = read_verifier_info(model_path)
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.num_samples,), generator=generator).tolist()
    tokens = loss_tokens = 0
    with open(data_dir / "tokenized_data.jsonl", "w") as handle:
        for index, length in enumerate(lengths):
            ids = torch.randint(3, info.vocab_size, (length,), generator=generator).tolist()
            mask = [0] * (length // 4) + [1] * (length - length // 4)
            handle.write(json.dumps({"id": f"bench-{index:06d}", "input_ids": ids, "loss_mask": mask}) + "\n")
            tokens += length
            loss_tokens += sum(mask)
    manifest = Manifest(data_dir, "01_prepare_data", {"bench_scaling": vars(args)})
    manifest.data["bench_data"] = key
    manifest.data["verifier"] = info.identity()
    manifest.data["counts"] = {"samples": len(lengths), "tokens": tokens, "loss_tokens": loss_tokens}
    manifest.complete()
    return data_dir / "tokenized_data.jsonl"


# --- running the stages ---------------------------------------------------------------------------------

def launch(script: str, nproc: int, stage_args: list[str]) -> tuple[float, str]:
    """A stage script on `nproc` processes through torchrun; (wall seconds, output). Raises on failure."""
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(REPO / script), *stage_args]
    note(" ".join(command))
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(REPO))
    wall = time.perf_counter() - started
    output = done.stdout + done.stderr
    if done.returncode != 0:
        sys.stderr.write(output[-6000:])
        raise SystemExit(f"{script} on {nproc} process(es) failed with exit code {done.returncode}")
    return wall, output


def extract(args, run: Path, model: str, data: Path, gpus: int, fresh: bool = True) -> dict:
    """Stage 02 into hidden_states_G; without `fresh`, a complete folder of an earlier call is kept (the
    stage finds nothing to do) and the record is that earlier run's."""
    out = run / f"hidden_states_{gpus}"
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    wall, _ = launch("02_extract_hidden_states.py", gpus, [
        "--model-path", model, "--prepared-data", str(data), "--output-dir", str(out), "--device", args.device,
        "--batch-size", str(args.batch_size), "--max-tokens-per-batch", str(args.extract_tokens_per_batch),
        "--num-workers", str(args.num_workers)])
    last = json.loads((out / "manifest.json").read_text())["last_run"]
    record = {"stage": "02", "gpus": gpus, "tokens": last["tokens_written"], "tokens_per_s": last["tokens_per_s"],
              "extract_s": last["elapsed_s"], "write_bytes_per_s": last["write_bytes_per_s"],
              "waited_for_writers_s": last["waited_for_writers_s"], "wall_s": round(wall, 1),
              "per_rank_tokens_per_s": [r["tokens_per_s"] for r in last.get("ranks", [last])]}
    emit(record)
    return record


def train(args, run: Path, model: str, data_dir: Path, gpus: int, fsdp: bool, global_accum: int,
          online_from: Path | None = None) -> dict:
    """Stage 04 for one epoch on stage 02's `data_dir`, or with `online_from` on that prepared data (--online)."""
    out = run / f"checkpoints_{gpus}{'_fsdp' if fsdp else ''}{'_online' if online_from else ''}"
    shutil.rmtree(out, ignore_errors=True)
    if global_accum % gpus:
        raise SystemExit(f"--global-accum {global_accum} is not a multiple of {gpus} GPUs")
    source = ["--online", "--prepared-data", str(online_from)] if online_from else ["--data-dir", str(data_dir)]
    wall, _ = launch("04_train.py", gpus, [
        *source, "--vocab-mapping-dir", str(run / "vocab"), "--output-dir", str(out),
        "--model-path", model, "--device", args.device, "--epochs", "1", "--grad-accum", str(global_accum // gpus),
        "--max-tokens-per-batch", str(args.max_tokens_per_batch), "--ttt-steps", str(args.ttt_steps),
        "--val-ratio", "0", "--save-interval", "1000000", "--keep-last", "1", "--log-interval", str(args.log_interval),
        "--num-workers", "4", "--seed", str(args.seed), *(["--fsdp"] if fsdp else []),
        *(["--min-steps", str(args.min_steps)] if args.min_steps is not None else [])])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for checkpoint in [*out.glob("epoch_*"), *out.glob("step_*")]:  # the disk: an 8B-shaped drafter's is 7 GB
        shutil.rmtree(checkpoint)
    windows = [line for line in lines if line["kind"] == "train"]
    timed = windows[1:] or windows  # the first window holds compilation and warm-up
    tokens = sum(w["tokens"] for w in timed)
    seconds = sum(w["tokens"] / w["tokens_per_s"] for w in timed if w["tokens_per_s"] > 0)
    record = {"stage": "04", "gpus": gpus, "parallelism": "fsdp" if fsdp else ("ddp" if gpus > 1 else "single"),
              "source": "online" if online_from else "offline", "grad_accum": global_accum // gpus, "optimizer_steps": windows[-1]["step"] if windows else 0,
              "timed_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
              "final_loss": windows[-1]["loss"] if windows else None, "wall_s": round(wall, 1),
              "max_memory_gib": max((w["max_memory_gib"] for w in windows if "max_memory_gib" in w), default=None)}
    emit(record)
    return record


def ratios(records: list[dict], key: str = "tokens_per_s") -> dict:
    base = next((r[key] for r in records if r["gpus"] == 1), None)
    return {f"{r['gpus']}{'_fsdp' if r.get('parallelism') == 'fsdp' else ''}": round(r[key] / base, 3)
            for r in records if base and r.get("source", "offline") == "offline"}


def online_against_offline(records: list[dict]) -> dict:
    """Per G (and parallelism): the online run's tokens/s over the offline run's, and both peak memories."""
    offline = {(r["gpus"], r["parallelism"]): r for r in records if r["source"] == "offline"}
    return {f"{r['gpus']}{'_fsdp' if r['parallelism'] == 'fsdp' else ''}": {
        "tokens_per_s_ratio": round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base["tokens_per_s"] else None,
        "max_memory_gib": {"offline": base.get("max_memory_gib"), "online": r.get("max_memory_gib")},
        "same_final_loss": base["final_loss"] is not None and r["final_loss"] is not None
        and abs(base["final_loss"] - r["final_loss"]) <= 1e-2 * abs(base["final_loss"])}
        for r in records if r["source"] == "online" and (base := offline.get((r["gpus"], r["parallelism"])))}


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu_counts = sorted({int(g) for g in args.gpus.split(",") if g.strip()})
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < max(gpu_counts):
            raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPU(s) visible")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_scaling_"))
    work.mkdir(parents=True, exist_ok=True)
    run = work / "run"
    model = args.model_path or str(random_llama(args.random_llama, work / f"random_llama_{args.random_llama}",
                                                args.device))
    note(f"verifier {model}; work folder {work}")
    data = write_prepared_data(run, model, args)
    # The real stage 03 (one process) on the same data.
    launch("03_build_vocab_mapping.py", 1, ["--prepared-data", str(data), "--output-dir", str(run / "vocab"),
                                            "--draft-vocab-size", str(args.draft_vocab_size), "--overwrite"])

    extraction = []
    for gpus in ([1] if args.skip_02 else gpu_counts):
        extraction.append(extract(args, run, model, data, gpus, fresh=not args.skip_02))
        if gpus != 1 and not args.keep:
            shutil.rmtree(run / f"hidden_states_{gpus}", ignore_errors=True)  # disk: stage 04 reads G=1's
    if 1 not in gpu_counts and not args.skip_02:
        raise SystemExit("--gpus must include 1 (the baseline, whose hidden states stage 04 reads)")
    global_accum = args.global_accum or max(gpu_counts)
    training = []
    for gpus in gpu_counts:
        training.append(train(args, run, model, run / "hidden_states_1", gpus, False, global_accum))
        if args.online:
            training.append(train(args, run, model, run / "hidden_states_1", gpus, False, global_accum, data))
        if args.fsdp and gpus > 1:
            training.append(train(args, run, model, run / "hidden_states_1", gpus, True, global_accum))

    result = {"bench": "bench_scaling", "device": args.device, "verifier": args.random_llama or args.model_path,
              "samples": args.num_samples, "tokens": extraction[0]["tokens"] if extraction else None,
              "stage02": {"runs": extraction, "tokens_per_s_ratio": ratios(extraction)},
              "stage04": {"runs": training, "tokens_per_s_ratio": ratios(training), "global_accum": global_accum,
                          "online_against_offline": online_against_offline(training)},
              "work_dir": str(work)}
    try:
        import torch

        result["torch"] = torch.__version__
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - informational only
        pass
    emit(result)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "bench_scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
