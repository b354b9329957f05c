#!/usr/bin/env python
"""Benchmark stage 02's extraction pipeline against the verifier's bare forward pass.

On the same synthetic batches, in one process, it measures (in the storage format stage 02's --aux-dtype,
--targets and --target-topk ask for; bf16 aux + final by default):
  forward_only  the base model's forward (no LM head, nothing captured or copied), twice (before and after);
  extraction    eagle3_pipeline.extract.extractor.Extractor.run, the exact code the stage runs: hooks, gather,
                side-stream copies into page-locked staging buffers, writer processes saving .pt files;
  naive         (optional) output_hidden_states=True, synchronous .cpu() copies, torch.save in the loop (bf16
                aux + final whatever the format);
  disk          the raw sequential write rate of the output disk (one big file + fsync), before and after
                the extraction, writing as many bytes as the extraction does.
and reports extraction / forward-only throughput and the write rates. Target: extraction >= 90% of
forward-only, or >= 80% of the disk's sequential rate where the disk is the limit. Extraction is timed until
its files are on the disk (the writers fdatasync every file, and a final os.sync() is counted), so the rate
is the sustained one a long run sees, not the page cache's.

    python scripts/lab/bench_extraction.py --random-llama8b                      # H200: 8B-shaped random Llama
    python scripts/lab/bench_extraction.py --random-shape smollm2 --aux-dtype float8_e4m3 --targets topk
    python scripts/lab/bench_extraction.py --model-path /models/SmolLM2-135M-Instruct
    python scripts/lab/bench_extraction.py --device cpu --model-path ../shared/models/stories260K \\
        --batch-size 4 --seq-len 64                                          # CPU smoke run

Prints one JSON object per line; the last line is the full result, also written to $OUT/bench_extraction.json
when $OUT is set. Files go to --output-dir (default: a fresh folder under the system temp dir), removed at
the end unless --keep-files.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle3_pipeline.cli.flags import FLAGS
from eagle3_pipeline.cli.parser import add_flags
from eagle3_pipeline.extract.extractor import Extractor, forward_only, synchronize_all
from eagle3_pipeline.extract.plan import batch_inputs, plan_batches
from eagle3_pipeline.formats.hidden_states import SAMPLE_FILES
from eagle3_pipeline.formats.prepared_data import Sample
from eagle3_pipeline.formats.storage import format_of_flags
from eagle3_pipeline.verifier.capture import find_text_model

# Random-weight verifiers of known shapes: extraction's speed does not depend on the weights' values.
RANDOM_SHAPES = {
    "llama8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", help="Hugging Face model folder of the verifier")
    source.add_argument("--random-shape", choices=sorted(RANDOM_SHAPES),
                        help="a randomly initialised Llama-architecture model of that shape (Llama-3.1-8B, "
                             "SmolLM2-135M), built in --dtype on the device: no checkpoint needed")
    source.add_argument("--random-llama8b", dest="random_shape", action="store_const", const="llama8b",
                        help="the same as --random-shape llama8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-batches", type=int, default=8, help="measured batches")
    parser.add_argument("--warmup-batches", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=8, help="writer processes (stage 02's --num-workers)")
    parser.add_argument("--aux-layers", default=None, help="a,b,c (default: the stage's default layers)")
    parser.add_argument("--naive-batches", type=int, default=2, help="batches for the naive baseline (0: skip)")
    parser.add_argument("--disk-test-mb", type=int, default=None,
                        help="size of each raw disk write test (default: the extraction's size; 0: skip)")
    parser.add_argument("--output-dir", default=None, help="scratch folder for the files (on the disk to test)")
    parser.add_argument("--keep-files", action="store_true")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    add_flags(parser, [FLAGS[name] for name in ("--aux-dtype", "--targets", "--target-topk")])
    return parser.parse_args(argv)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        synchronize_all()


def build_random_llama(shape: str, device: str, dtype: torch.dtype):
    """A Llama model of RANDOM_SHAPES[shape], weights allocated on the device and filled there (no CPU init,
    no checkpoint)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    config = LlamaConfig(**RANDOM_SHAPES[shape])
    with torch.device(device), no_init_weights():
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.fill_(1.0)  # norms
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    return model.eval(), config.num_hidden_layers, config.hidden_size, config.vocab_size


def load_model(args, device: str, compute_dtype: str):
    from eagle3_pipeline.verifier.loading import load_verifier_model, read_verifier_info

    info = read_verifier_info(args.model_path, args.trust_remote_code, with_tokenizer_hash=False)
    return info, lambda: load_verifier_model(args.model_path, device, compute_dtype, args.trust_remote_code)


def synthetic_samples(count: int, seq_len: int, vocab_size: int, seed: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for position in range(count):
        ids = torch.randint(3, vocab_size, (seq_len,), generator=generator)
        mask = torch.zeros(seq_len, dtype=torch.uint8)
        mask[seq_len // 4:] = 1
        samples.append(Sample(position=position, id=f"bench-{position:06d}", input_ids=ids, loss_mask=mask))
    return samples


def naive_extract(text, samples, batches, layers, store_dtype, folder: Path) -> dict:
    """The obvious implementation: all hidden states, synchronous copies, torch.save in the loop."""
    device = text.input_device
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids, _ = batch_inputs(samples, batch, pin=False)
            out = text.base(input_ids=ids.to(device), output_hidden_states=True, use_cache=False)
            states = [out.hidden_states[layer] for layer in layers] + [out.last_hidden_state]
            for row, index in enumerate(batch):
                sample = samples[index]
                target = folder / sample.rel_path
                target.mkdir(parents=True, exist_ok=True)
                for name, state in zip(SAMPLE_FILES, states):
                    torch.save(state[row, :sample.num_tokens].to(store_dtype).cpu().clone(), target / name)
                torch.save({"input_ids": sample.input_ids, "loss_mask": sample.loss_mask}, target / SAMPLE_FILES[-1])
                tokens += sample.num_tokens
    elapsed = time.perf_counter() - started
    return {"tokens": tokens, "elapsed_s": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1)}


def disk_write_rate(folder: Path, megabytes: int) -> dict:
    """Sequential write of one big file in 64 MB blocks, fsync included."""
    if megabytes <= 0:
        return {"skipped": True}
    block = os.urandom(64 * 1024 * 1024)
    path = folder / "disk_write_test.bin"
    written = 0
    started = time.perf_counter()
    with open(path, "wb") as handle:
        while written < megabytes * 1024 * 1024:
            handle.write(block)
            written += len(block)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return {"bytes": written, "elapsed_s": round(elapsed, 3),
            "sequential_write_bytes_per_s": round(written / elapsed, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU visible: use --device cpu", file=sys.stderr)
        return 2
    store_dtype = getattr(torch, args.dtype)
    compute_dtype = args.dtype if device != "cpu" else "float32"
    scratch = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="bench_extraction_"))
    scratch.mkdir(parents=True, exist_ok=True)
    out_dir = scratch / "extraction"

    if args.random_shape:
        shape = RANDOM_SHAPES[args.random_shape]
        num_layers, hidden, vocab = shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]
        build_dtype = store_dtype if device != "cpu" else torch.float32
        make_model = lambda: build_random_llama(args.random_shape, device, build_dtype)[0]  # noqa: E731
        model_name = f"random-{args.random_shape}-shape"
    else:
        info, make_model = load_model(args, device, compute_dtype)
        num_layers, hidden, vocab = info.num_layers, info.hidden_size, info.vocab_size
        model_name = args.model_path
    from eagle3_pipeline.formats.layer_ids import check_aux_layers, default_aux_layers

    layers = check_aux_layers([int(x) for x in args.aux_layers.split(",")] if args.aux_layers
                              else default_aux_layers(num_layers), num_layers)

    total_batches = args.warmup_batches + args.num_batches
    samples = synthetic_samples(total_batches * args.batch_size, args.seq_len, vocab, args.seed)
    batches = plan_batches(samples, args.batch_size, args.batch_size * args.seq_len)
    warmup, measured = batches[:args.warmup_batches], batches[args.warmup_batches:]
    tokens = sum(samples[i].num_tokens for b in measured for i in b)
    storage = format_of_flags(args.dtype, args.aux_dtype, args.targets, args.target_topk, vocab)
    bytes_per_token = storage.bytes_per_token(hidden)
    result = {"bench": "extraction", "model": model_name, "device": device,
              "device_name": platform.processor(),
              "cpu_count": os.cpu_count(), "torch": torch.__version__, "dtype": args.dtype,
              "compute_dtype": compute_dtype, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "num_batches": len(measured), "tokens": tokens, "aux_layers": layers, "hidden_size": hidden,
              "num_workers": args.num_workers, "storage": storage.key(), "output_dir": str(scratch)}
    emit({"phase": "setup", **result})
    disk_mb = args.disk_test_mb if args.disk_test_mb is not None else max(1, tokens * bytes_per_token >> 20)
    try:
        disk_before = disk_write_rate(scratch, disk_mb)
        emit({"phase": "disk_before", **disk_before})
        # Writers are forked before the model exists, as in the stage.
        with Extractor(out_dir, samples, batches, layers, hidden, store_dtype, args.num_workers,
                       storage=storage) as extractor:
            if device.startswith("cuda"):  # only now: the writers were forked before CUDA started here
                result["device_name"] = torch.cuda.get_device_name()
            started = time.perf_counter()
            model = make_model()
            synchronize(device)
            text = find_text_model(model, num_layers)
            emit({"phase": "model_ready", "seconds": round(time.perf_counter() - started, 1), "text_model": text.name})

            # warm up kernels, allocator, staging and writers
            if warmup:
                forward_only(text, samples, warmup)
                extractor.run(text, warmup)
            synchronize(device)

            fwd1 = forward_only(text, samples, measured)
            emit({"phase": "forward_only", "seconds": round(fwd1, 3), "tokens_per_s": round(tokens / fwd1, 1)})

            extraction = extractor.run(text, measured).as_dict()
            # Count whatever the kernel still holds: the rate is the one at which data reaches the disk.
            elapsed = extraction["elapsed_s"]
            sync_started = time.perf_counter()
            os.sync()
            sync_s = time.perf_counter() - sync_started
            extraction["sync_after_s"] = round(sync_s, 3)
            extraction["window_tokens_per_s"] = extraction["tokens_per_s"]
            extraction["elapsed_s"] = round(elapsed + sync_s, 3)
            extraction["tokens_per_s"] = round(extraction["tokens_written"] / (elapsed + sync_s), 1)
            extraction["write_bytes_per_s"] = round(extraction["bytes_written"] / (elapsed + sync_s), 1)
            emit({"phase": "extraction", **extraction})

            fwd2 = forward_only(text, samples, measured)
            emit({"phase": "forward_only_again", "seconds": round(fwd2, 3), "tokens_per_s": round(tokens / fwd2, 1)})

            naive = None
            if args.naive_batches > 0:
                naive = naive_extract(text, samples, measured[:args.naive_batches], layers, store_dtype,
                                      scratch / "naive")
                emit({"phase": "naive_baseline", **naive})
        disk_after = disk_write_rate(scratch, disk_mb)
        emit({"phase": "disk_after", **disk_after})
    finally:
        if not args.keep_files:
            shutil.rmtree(scratch, ignore_errors=True)

    forward_rate = tokens / min(fwd1, fwd2)
    ratio = extraction["tokens_per_s"] / forward_rate
    result["forward_only"] = {"tokens_per_s": round(forward_rate, 1), "runs_s": [round(fwd1, 3), round(fwd2, 3)]}
    result["extraction"] = extraction
    result["naive_baseline"] = naive
    # The disk's rate drifts between runs; the better of the two measurements is the stricter reference.
    disk = max((disk_before, disk_after), key=lambda d: d.get("sequential_write_bytes_per_s", 0))
    result["disk"] = {"before": disk_before, "after": disk_after,
                      "sequential_write_bytes_per_s": disk.get("sequential_write_bytes_per_s")}
    result["extraction_vs_forward"] = round(ratio, 4)
    result["bytes_per_token"] = bytes_per_token
    needed_rate = forward_rate * bytes_per_token
    disk_rate = disk.get("sequential_write_bytes_per_s")
    result["write_rate_needed_at_forward_speed"] = round(needed_rate, 1)
    if disk_rate:
        result["disk_limited"] = needed_rate > disk_rate
        result["extraction_write_vs_disk"] = round(extraction["write_bytes_per_s"] / disk_rate, 4)
    if naive:
        result["naive_vs_forward"] = round(naive["tokens_per_s"] / forward_rate, 4)
    result["target_met"] = bool(ratio >= 0.9 or (result.get("disk_limited") and
                                                 result.get("extraction_write_vs_disk", 0) >= 0.8))
    emit(result)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        with open(Path(os.environ["OUT"]) / "bench_extraction.json", "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
