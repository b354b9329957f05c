#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 drafter on the verifier's stored hidden states.

Before any heavy work it checks that the hidden states (stage 02) and the vocabulary map (stage 03) are
complete, come from the same verifier (tokenizer, vocabulary, hidden size) and from the same prepared
data (a map built from other data is refused as stale), that --model-path is that verifier, and that a
--finetune-from drafter fits them (hidden size, vocabularies, aux layers). The verifier is never loaded:
its embed_tokens and lm_head are read alone from its safetensors shards.

Training: AdamW (0.9, 0.95) with warmup and cosine/linear/constant decay, gradient clipping and
accumulation, bf16 on GPU (bf16 parameters with fp32 master weights and moments; float32 on CPU),
length-bucketed batches of at most --max-tokens-per-batch padded
tokens, a --val-ratio hold-out (split by sample, seeded). Every --eval-interval steps and at each epoch
end: loss and top-1 agreement per TTT step and the simulated acceptance length on the validation split
(metrics.jsonl, the log, TensorBoard if installed). Every --save-interval steps and at each epoch end:
an SGLang-ready drafter folder with the full training state (step_N/, epoch_N/), `latest` and `best`
pointers, older step folders pruned to --keep-last. --resume continues a stopped run exactly.

Under torchrun (several processes, one GPU each) the drafter trains data-parallel: DDP, or FSDP with
--fsdp. An optimizer step takes --grad-accum micro-batches on every rank, so 2 GPUs with --grad-accum 1
train exactly as 1 GPU with --grad-accum 2; rank 0 writes checkpoints, logs and metrics (summed over the
ranks), and a run resumes on another number of ranks when --grad-accum x ranks stays the same.
"""
from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from common.formats.manifest import MANIFEST, Manifest, check_same, check_verifier_matches, load_manifest
from common.formats.files import read_json, sha256_file, write_json_atomic
from common.cli.errors import UsageError
from common.cli.flags import parse_stage_args
from common.cli.stage import run_stage
from common.formats.layer_ids import check_aux_layers
from common.verifier.loading import VerifierInfo, locate_embedding_tensors, pick_device, read_verifier_info

STAGE = "04_train"
UPSTREAM_HIDDEN = "02_extract_hidden_states"
UPSTREAM_VOCAB = "03_build_vocab_mapping"
DEFAULT_TOKENS_PER_BATCH = 8192
OFFLOAD_EMBEDDING_BYTES = 1 << 28  # as scripts/bench_train_step.py's "auto": embeddings of 256 MB and more
UNLIMITED_SEQUENCES = 1 << 30
# Flags (and input hashes) a resumed run must share with the run it continues: they decide the split,
# the batch plan, the schedule and the loss, so changing one would not continue that run.
# The global batch counts, not --grad-accum: micro_batches_per_step = --grad-accum x ranks.
RESUME_KEYS = ("seed", "epochs", "lr", "scheduler", "warmup_ratio", "micro_batches_per_step", "max_grad_norm",
               "max_seq_len", "ttt_steps", "ttt_decay", "noise_std", "val_ratio", "max_tokens", "max_sequences",
               "finetune_from", "compute_dtype", "hidden_states_index_sha256", "vocab_mapping_sha256")


def parse(argv):
    return parse_stage_args(STAGE, __doc__, argv)


@dataclass
class Inputs:
    data_dir: Path
    data_manifest: dict
    entries: list[dict]
    vocab_dir: Path
    vocab_manifest: dict
    mapping: object  # common.formats.vocab_map.VocabMapping
    verifier: VerifierInfo
    aux_layers: list[int]
    max_tokens: int
    max_sequences: int


# --- input checks (all before anything heavy) ------------------------------------------------------------

def check_hidden_states(args) -> tuple[Path, dict, list[dict]]:
    from common.extract.extraction import open_hidden_states

    if not args.data_dir:
        raise UsageError("give --data-dir (stage 02's hidden_states folder) or --run-dir")
    data_dir = Path(args.data_dir)
    manifest, entries = open_hidden_states(data_dir)  # refuses a missing, foreign or unfinished folder
    expected = (manifest.get("counts") or {}).get("samples")
    if expected is not None and len(entries) != int(expected):
        raise UsageError(f"--data-dir {data_dir}: the index lists {len(entries)} samples but {MANIFEST} counts "
                         f"{expected}; rerun {UPSTREAM_HIDDEN}.py, which completes what is missing")
    missing = [entry["path"] for entry in entries if not (data_dir / entry["path"]).is_dir()]
    if missing:
        raise UsageError(f"--data-dir {data_dir}: {len(missing)} indexed sample folders are missing (first: "
                         f"{', '.join(missing[:3])}); rerun {UPSTREAM_HIDDEN}.py, which redoes missing samples")
    # Samples without a loss token teach nothing (and would only cost reading them).
    entries = [entry for entry in entries if int(entry.get("loss_tokens", 1)) > 0]
    if not entries:
        raise UsageError(f"--data-dir {data_dir}: the index lists no complete sample with loss tokens; rerun "
                         f"{UPSTREAM_HIDDEN}.py on data with assistant turns")
    for key in ("aux_layers", "hidden_size"):
        if key not in manifest:
            raise UsageError(f"{data_dir / MANIFEST} records no {key!r}; rerun {UPSTREAM_HIDDEN}.py")
    return data_dir, manifest, entries


def check_vocab(args, data_dir: Path, data_manifest: dict):
    from common.formats.checkpoint import vocab_mapping_problems
    from common.formats.vocab_map import load_mapping

    if not args.vocab_mapping_dir:
        raise UsageError("give --vocab-mapping-dir (stage 03's vocab folder) or --run-dir")
    vocab_dir = Path(args.vocab_mapping_dir)
    manifest = load_manifest(vocab_dir, UPSTREAM_VOCAB, "--vocab-mapping-dir")
    data_name, vocab_name = str(data_dir / MANIFEST), str(vocab_dir / MANIFEST)
    check_verifier_matches(data_manifest, data_name, manifest.get("verifier", {}), vocab_name)
    check_same_prepared_data(data_manifest, data_name, manifest, vocab_name)
    mapping = load_mapping(vocab_dir)
    vocab_size = int((data_manifest.get("verifier") or {}).get("vocab_size") or len(mapping.t2d))
    draft_vocab_size = int(manifest.get("draft_vocab_size") or len(mapping.d2t))
    # The file must be what the manifest describes (a map replaced after the fact is stale too).
    problems = vocab_mapping_problems(mapping.d2t, mapping.t2d, draft_vocab_size, vocab_size)
    if problems:
        raise UsageError(f"{vocab_dir}: the vocabulary map does not match its manifest or the hidden states: "
                         f"{'; '.join(problems)}. Rerun {UPSTREAM_VOCAB}.py --overwrite")
    return vocab_dir, manifest, mapping


def check_same_prepared_data(data_manifest: dict, data_name: str, vocab_manifest: dict, vocab_name: str) -> None:
    """A vocabulary map built from other prepared data than the hidden states is stale: refuse it."""
    ours = data_manifest.get("inputs", {}).get("prepared_data", {})
    theirs = vocab_manifest.get("inputs", {}).get("prepared_data", {})
    if not ours.get("manifest_sha256") or not theirs.get("manifest_sha256"):
        from common.cli.stage import get_logger

        get_logger().warning("cannot tell whether %s and %s come from the same prepared data (no "
                             "inputs.prepared_data.manifest_sha256 recorded)", data_name, vocab_name)
        return
    if ours["manifest_sha256"] != theirs["manifest_sha256"]:
        raise UsageError(
            f"stale vocabulary map: {vocab_name} was built from the prepared data {theirs.get('path')} "
            f"(its manifest sha256 {theirs['manifest_sha256'][:16]}...), but the hidden states {data_name} come "
            f"from {ours.get('path')} (manifest sha256 {ours['manifest_sha256'][:16]}...). Rebuild the map from "
            f"the same data: 03_build_vocab_mapping.py --prepared-data {ours.get('path')} --overwrite "
            f"(or point --vocab-mapping-dir at the map of that data)")


def check_verifier(args, data_dir: Path, data_manifest: dict) -> tuple[VerifierInfo, list[int]]:
    """--model-path (default: the verifier the hidden states record) must be the verifier of the data."""
    recorded = data_manifest.get("verifier", {})
    model_path = args.model_path or recorded.get("path")
    if not model_path:
        raise UsageError(f"give --model-path (the verifier); {data_dir / MANIFEST} records none")
    args.model_path = model_path
    info = read_verifier_info(model_path, args.trust_remote_code)
    name = str(data_dir / MANIFEST)
    check_verifier_matches(data_manifest, name, info.identity(), f"--model-path {model_path}")
    fix = f"Use the verifier the hidden states were extracted from ({recorded.get('path')})."
    check_same("hidden_size", data_manifest.get("hidden_size"), name, info.hidden_size, f"--model-path {model_path}", fix)
    check_same("num_layers", recorded.get("num_layers"), name, info.num_layers, f"--model-path {model_path}", fix)
    try:
        aux_layers = check_aux_layers(list(data_manifest["aux_layers"]), info.num_layers)
    except UsageError as err:
        raise UsageError(f"{name}: {err}")
    from common.formats.layer_ids import eagle_config_layer_ids

    try:  # a drafter SGLang could never feed (vLLM can): say so before training it
        eagle_config_layer_ids(aux_layers, info.architecture)
    except ValueError as err:
        logging.getLogger(STAGE).warning("%s: %s; vLLM can serve this drafter, SGLang cannot (rerun "
                                         "02_extract_hidden_states.py with other --aux-layers for SGLang)", name, err)
    locate_embedding_tensors(model_path)  # safetensors index/headers only: the tensors are read later
    return info, aux_layers


def check_finetune(args, data_manifest: dict, info: VerifierInfo, mapping) -> None:
    if not args.finetune_from:
        return
    from common.formats.checkpoint import check_drafter_dir
    from common.model.config import DrafterConfig

    folder = Path(args.finetune_from)
    if not (folder / "config.json").exists():
        raise UsageError(f"--finetune-from {folder}: no config.json there; give an EAGLE-3 drafter folder")
    problems = list(check_drafter_dir(folder, data_manifest=data_manifest, verifier_info=info))
    try:
        config = DrafterConfig.from_sglang_config(read_json(folder / "config.json"))
    except (ValueError, TypeError, KeyError) as err:
        raise UsageError(f"--finetune-from {folder}: config.json is not an EAGLE-3 drafter config ({err})")
    if config.draft_vocab_size != len(mapping.d2t):
        problems.append(f"its draft_vocab_size is {config.draft_vocab_size} but the vocabulary map "
                        f"{args.vocab_mapping_dir} has {len(mapping.d2t)} (rebuild the map with "
                        f"--draft-vocab-size {config.draft_vocab_size})")
    if problems:
        raise UsageError(f"--finetune-from {folder} does not fit this run:\n  " + "\n  ".join(problems))


def resolve_batching(args, entries: list[dict]) -> tuple[int, int]:
    """(max padded tokens, max sequences) per micro-batch, from --max-tokens-per-batch and --batch-size."""
    max_sequences = args.batch_size or UNLIMITED_SEQUENCES
    if args.max_tokens_per_batch:
        max_tokens = args.max_tokens_per_batch
    elif args.batch_size:
        max_tokens = args.batch_size * args.max_seq_len
    else:
        max_tokens = max(DEFAULT_TOKENS_PER_BATCH, args.max_seq_len)
    longest = max(min(int(e["num_tokens"]), args.max_seq_len) for e in entries)
    if longest > max_tokens:
        raise UsageError(f"--max-tokens-per-batch {max_tokens} is below the longest sample ({longest} tokens "
                         f"after --max-seq-len {args.max_seq_len}): raise it or lower --max-seq-len")
    return max_tokens, max_sequences


def check_inputs(args, log) -> Inputs:
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: give one")
    data_dir, data_manifest, entries = check_hidden_states(args)
    vocab_dir, vocab_manifest, mapping = check_vocab(args, data_dir, data_manifest)
    info, aux_layers = check_verifier(args, data_dir, data_manifest)
    check_finetune(args, data_manifest, info, mapping)
    max_tokens, max_sequences = resolve_batching(args, entries)
    device = pick_device(args.device)  # a missing GPU is an input error, found now
    if device.startswith("cuda") and args.dtype == "float16":
        raise UsageError("--dtype float16: stage 04 trains in bfloat16 (or float32); float16 would need loss "
                         "scaling. Use --dtype bfloat16")
    log.info("inputs: %d hidden-state samples (%s, aux layers %s), draft vocabulary %d of %d, verifier %s",
             len(entries), data_dir, aux_layers, len(mapping.d2t), len(mapping.t2d), info.path)
    return Inputs(data_dir, data_manifest, entries, vocab_dir, vocab_manifest, mapping, info, aux_layers,
                  max_tokens, max_sequences)


def run_config_of(args, inputs: Inputs, world_size: int = 1) -> dict:
    from common.train.training import compute_dtype_for

    flags = ("seed", "epochs", "lr", "scheduler", "warmup_ratio", "grad_accum", "max_grad_norm", "max_seq_len",
             "ttt_steps", "ttt_decay", "noise_std", "val_ratio")
    return {
        **{key: getattr(args, key) for key in flags},
        "world_size": world_size, "micro_batches_per_step": args.grad_accum * world_size,
        "max_tokens": inputs.max_tokens, "max_sequences": inputs.max_sequences,
        "finetune_from": str(Path(args.finetune_from).resolve()) if args.finetune_from else None,
        "compute_dtype": compute_dtype_for(pick_device(args.device), args.dtype),
        "hidden_states_index_sha256": sha256_file(_index_path(inputs.data_dir, inputs.data_manifest)),
        "vocab_mapping_sha256": sha256_file(inputs.vocab_dir / "vocab_mapping.safetensors"),
    }


def _index_path(data_dir: Path, data_manifest: dict) -> Path:
    return data_dir / data_manifest.get("index", "index.jsonl")


def check_output(args, run_config: dict, log) -> tuple[Path | None, bool]:
    """(checkpoint to resume from or None, whether earlier outputs must be cleared before starting).
    Refuses to mix two runs in one folder."""
    from common.train.training import CheckpointManager, TRAINER_STATE_JSON

    output_dir = Path(args.output_dir)
    manager = CheckpointManager(output_dir, args.keep_last)
    if args.overwrite:
        return None, manager.has_outputs()
    if not args.resume:
        if manager.has_outputs():
            latest = manager.pointer_target("latest")
            raise UsageError(f"--output-dir {output_dir} already holds checkpoints of a run"
                             f"{f' (latest: {latest})' if latest else ''}: pass --resume to continue it, "
                             f"--overwrite to delete them and start over, or choose another --output-dir")
        return None, False
    point = manager.resume_point()
    if point is None:
        # A run that stopped before its first checkpoint: start it again, without its stray metrics.
        log.warning("--resume: no complete checkpoint in %s; starting from the beginning", output_dir)
        return None, manager.has_outputs()
    previous = read_json(point / TRAINER_STATE_JSON).get("run_config", {})
    if "micro_batches_per_step" not in previous and "grad_accum" in previous:  # saved before torchrun: 1 process
        previous = {**previous, "micro_batches_per_step": previous["grad_accum"]}
    changed = [f"{key}: was {previous.get(key)!r}, now {run_config.get(key)!r}" for key in RESUME_KEYS
               if key in previous and previous.get(key) != run_config.get(key)]
    if any(line.startswith("micro_batches_per_step") for line in changed):
        changed.append(f"(micro_batches_per_step = --grad-accum x ranks; the run being resumed had --grad-accum "
                       f"{previous.get('grad_accum')} on {previous.get('world_size', 1)} rank(s): on "
                       f"{run_config['world_size']} rank(s) give --grad-accum "
                       f"{previous['micro_batches_per_step'] / run_config['world_size']:g})")
    if changed:
        raise UsageError(f"--resume from {point}: these settings or inputs differ from the run being resumed, "
                         f"so it could not continue exactly:\n  " + "\n  ".join(changed) +
                         "\nRerun with the original values, or start over with --overwrite (or another --output-dir)")
    return point, False


def check_disk(args, model_params: int, log) -> None:
    """Every kept checkpoint holds the weights and AdamW's fp32 moments (and fp32 master weights for bf16):
    at most 16 bytes a trainable parameter."""
    output_dir = Path(args.output_dir)
    per_checkpoint = model_params * 16
    kept = args.keep_last + args.epochs + 1
    need = per_checkpoint * kept
    free = shutil.disk_usage(output_dir).free
    if free < need:
        message = (f"{output_dir}: {free / 1e9:.1f} GB free, but up to {kept} checkpoints of about "
                   f"{per_checkpoint / 1e9:.2f} GB each may be kept ({need / 1e9:.1f} GB): free space, lower "
                   f"--keep-last, or pass --allow-low-disk")
        if not args.allow_low_disk:
            raise UsageError(message)
        log.warning(message)


# --- the work --------------------------------------------------------------------------------------------

def build_drafter(args, inputs: Inputs, tensors: dict, device: str, dtype):
    """A new drafter (embedding and lm_head rows from the verifier), or the --finetune-from one."""
    import torch
    from common.formats.checkpoint import load_drafter
    from common.model.config import DrafterConfig
    from common.model.drafter import Eagle3Drafter
    from common.train.training import cast_parameters

    if args.finetune_from:
        return load_drafter(args.finetune_from, embed=tensors["embed_tokens"], device=device, dtype=dtype)
    config = DrafterConfig.from_verifier(inputs.verifier, len(inputs.mapping.d2t), inputs.aux_layers)
    with torch.device(device):
        model = Eagle3Drafter(config)
    model.init_from_verifier(tensors["embed_tokens"], tensors["lm_head"], inputs.mapping.d2t, inputs.mapping.t2d)
    return cast_parameters(model, dtype)


def report_vocab_of_finetuned(args, model, inputs: Inputs, log) -> None:
    """A --finetune-from drafter keeps its own draft vocabulary: its lm_head rows belong to it."""
    if not args.finetune_from:
        return
    import torch

    theirs = set((torch.arange(len(model.d2t)) + model.d2t.cpu()).tolist())
    ours = set(inputs.mapping.draft_ids.tolist())
    if theirs != ours:
        log.warning("--finetune-from %s keeps its own draft vocabulary (its lm_head rows are trained for it); "
                    "%d of its %d tokens are not in the map of %s built from this data", args.finetune_from,
                    len(theirs - ours), len(theirs), inputs.vocab_dir)


def count_parameters(inputs: Inputs) -> int:
    """Trainable parameters, counted on the meta device (no memory, no time)."""
    import torch
    from common.model.config import DrafterConfig
    from common.model.drafter import Eagle3Drafter

    config = DrafterConfig.from_verifier(inputs.verifier, len(inputs.mapping.d2t), inputs.aux_layers)
    with torch.device("meta"):
        model = Eagle3Drafter(config)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def rank_device(args, rank) -> str:
    """This process's device: under torchrun on GPUs, cuda:LOCAL_RANK (one GPU a rank)."""
    device = pick_device(args.device)
    if not (rank.distributed and device.startswith("cuda")):
        return device
    import torch

    if torch.cuda.device_count() < rank.local_world_size:
        raise UsageError(f"{rank.local_world_size} processes on this node but {torch.cuda.device_count()} visible "
                         f"GPU(s): stage 04 runs one process a GPU (torchrun --nproc_per_node)")
    return f"cuda:{rank.local_rank}"


def check_fp8(args, device: str) -> None:
    if not args.fp8:
        return
    import torch
    from common.model.kernels import fp8_available

    if not fp8_available(torch.device(device)):
        raise UsageError(f"--fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell), "
                         f"and {device} has none: drop --fp8")


def work(args, log, hooks=()):
    from common.cli import distributed

    rank = distributed.rank_info()
    # Every rank checks everything (read-only), so a bad input stops all of them with exit code 2.
    inputs = check_inputs(args, log)
    run_config = run_config_of(args, inputs, rank.world_size)
    resume_from, clear_first = check_output(args, run_config, log)
    check_disk(args, count_parameters(inputs), log)
    device = rank_device(args, rank)
    check_fp8(args, device)
    if args.fsdp and not rank.distributed:
        log.warning("--fsdp shards over the ranks of a torchrun launch; this single process trains as usual")
    with distributed.process_group("cuda" if device.startswith("cuda") else "cpu") as rank:
        distributed.barrier()  # every rank has read the output folder before rank 0 changes it
        if clear_first and rank.is_main:  # only now that every check has passed
            from common.train.training import CheckpointManager

            log.info("removing the earlier run's checkpoints and metrics in %s", args.output_dir)
            CheckpointManager(args.output_dir, args.keep_last).clear()
        train(args, log, inputs, run_config, resume_from, device, rank, hooks)
        distributed.barrier()  # rank 0 has written its last checkpoint and the manifest


def train(args, log, inputs: Inputs, run_config: dict, resume_from: Path | None, device: str, rank, hooks) -> None:
    import torch
    from common.formats.checkpoint import check_drafter_dir
    from common.train.training import (HiddenStateDataset, LoopConfig, TrainConfig, Trainer, VAL_SPLIT_FILE,
        seed_everything, signal_hooks_for_tests, split_train_val)
    from common.verifier.loading import read_embedding_tensors

    output_dir = Path(args.output_dir)
    manifest = Manifest(output_dir, STAGE, vars(args))
    manifest.add_input("hidden_states", inputs.data_dir, inputs.data_dir / MANIFEST)
    manifest.add_input("vocab_mapping", inputs.vocab_dir, inputs.vocab_dir / MANIFEST)
    if args.finetune_from:
        manifest.add_input("finetune_from", args.finetune_from, Path(args.finetune_from) / MANIFEST)
    manifest.data["verifier"] = inputs.verifier.identity()
    manifest.data.update(aux_layers=inputs.aux_layers, draft_vocab_size=len(inputs.mapping.d2t),
                         resumed_from=str(resume_from) if resume_from else None, world_size=rank.world_size,
                         parallelism=("fsdp" if args.fsdp else "ddp") if rank.distributed else None)
    if rank.is_main:
        manifest.write()

    seed_everything(args.seed)  # the same on every rank: the same initial drafter
    log.info("reading embed_tokens and lm_head of %s (the verifier itself is not loaded)", args.model_path)
    tensors = read_embedding_tensors(args.model_path)
    compute_dtype = run_config["compute_dtype"]
    dtype = getattr(torch, compute_dtype)
    model = build_drafter(args, inputs, tensors, device, dtype)
    report_vocab_of_finetuned(args, model, inputs, log)
    if args.fp8:
        model.use_fp8()
        log.info("--fp8: the drafter's GEMMs run on FP8 tensor cores (parameters and optimizer stay %s)",
                 compute_dtype)
    if device.startswith("cuda") and model.embed_tokens.weight.numel() * 2 >= OFFLOAD_EMBEDDING_BYTES:
        # The frozen [V, H] embedding (2.3 GB for Kimi) stays in pinned CPU memory; lookups copy rows over.
        model.offload_embedding()
        log.info("the frozen embedding is kept in CPU memory (saves %.1f GB of GPU memory)",
                 model.embed_tokens.weight.numel() * 2 / 1e9)
    # The targets come from the verifier's lm_head; it stays in the compute dtype on the device.
    verifier_lm_head = tensors["lm_head"].to(device=device, dtype=dtype)
    del tensors
    log.info("drafter: %.1f M trainable parameters, computing in %s on %s%s",
             sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, compute_dtype, device,
             f" (rank 0 of {rank.world_size}, {'FSDP' if args.fsdp else 'DDP'})" if rank.distributed else "")

    ids = [str(entry["id"]) for entry in inputs.entries]
    train_pos, val_pos = split_train_val(ids, args.val_ratio, args.seed)
    train_set = HiddenStateDataset(inputs.data_dir, [inputs.entries[i] for i in train_pos], args.max_seq_len)
    val_set = HiddenStateDataset(inputs.data_dir, [inputs.entries[i] for i in val_pos], args.max_seq_len)
    if rank.is_main:
        write_json_atomic(output_dir / VAL_SPLIT_FILE, {"seed": args.seed, "val_ratio": args.val_ratio,
                                                        "train_samples": len(train_pos),
                                                        "val_ids": [ids[i] for i in val_pos]})

    cfg = TrainConfig(lr=args.lr, scheduler=args.scheduler, warmup_ratio=args.warmup_ratio,
                      max_grad_norm=args.max_grad_norm, grad_accum=args.grad_accum, ttt_steps=args.ttt_steps,
                      ttt_decay=args.ttt_decay, noise_std=args.noise_std, device=device, dtype=compute_dtype,
                      fp8=args.fp8)
    loop = LoopConfig(epochs=args.epochs, max_tokens=inputs.max_tokens, max_sequences=inputs.max_sequences,
                      num_workers=args.num_workers, seed=args.seed, eval_interval=args.eval_interval,
                      save_interval=args.save_interval, log_interval=args.log_interval)
    parallel = None
    if rank.distributed:
        from common.train.data_parallel import make_data_parallel

        parallel = make_data_parallel(rank, device, args.fsdp)
    trainer = Trainer(model, verifier_lm_head, cfg, loop, train_set, val_set, output_dir, args.keep_last,
                      run_config,
                      validate_checkpoint=lambda path: check_drafter_dir(path, data_manifest=inputs.data_manifest,
                                                                         verifier_info=inputs.verifier),
                      is_main=rank.is_main, hooks=[*hooks, *signal_hooks_for_tests(rank.rank)], parallel=parallel)
    if resume_from is not None:
        trainer.load_training_state(resume_from)
        log.info("resumed from %s: step %d, epoch %d, %d batches of that epoch done", resume_from,
                 trainer.state.step, trainer.state.epoch + 1, trainer.state.batches_consumed)
    manifest.data["counts"] = {"train_samples": len(train_set), "val_samples": len(val_set),
                               "train_tokens": sum(train_set.lengths()), "optimizer_steps": trainer.total_steps}
    if rank.is_main:
        manifest.write()

    result = trainer.fit()
    if not rank.is_main:
        return
    manifest.data.update(best=result.get("best"), best_val_sim_accept_len=result.get("best_value"),
                         latest=trainer.checkpoints.pointer_target("latest"), last_eval=result.get("last_eval"))
    manifest.complete()
    log.info("training done: %d steps; best checkpoint %s (validation simulated acceptance length %s); "
             "serve it with --speculative-draft-model-path %s", trainer.state.step, result.get("best"),
             result.get("best_value"), output_dir / "best")


def main(argv=None, hooks=()) -> int:
    """`hooks` (in-process callers only): called as hook(trainer) after every optimizer step."""
    return run_stage(STAGE, parse, lambda args, log: work(args, log, hooks), argv)


if __name__ == "__main__":
    sys.exit(main())
