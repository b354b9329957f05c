"""Stage 04's work once its inputs are checked: the drafter built (or loaded for --finetune-from) and
trained by the Trainer, with the stage's manifest."""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3_pipeline.formats.disk_full import full_disk_reported
from eagle3_pipeline.formats.manifest import MANIFEST, Manifest
from eagle3_pipeline.formats.files import write_json_atomic
from eagle3_pipeline.model.drafter import Eagle3Drafter
from eagle3_pipeline.model.checkpoint import check_drafter_dir, load_drafter
from eagle3_pipeline.train.data import VAL_SPLIT_FILE
from eagle3_pipeline.train.checkpoints import seed_everything
from eagle3_pipeline.train.data_parallel import make_data_parallel
from eagle3_pipeline.train.inputs import STAGE, Inputs
from eagle3_pipeline.train.online import load_online_states
from eagle3_pipeline.train.parameters import cast_parameters
from eagle3_pipeline.train.plots import CURVES_FILE, remove_stale_drawings, training_title, write_training_curves
from eagle3_pipeline.train.step import TrainConfig
from eagle3_pipeline.train.profiling import StepProfiler
from eagle3_pipeline.train.trainer import LoopConfig, Trainer
from eagle3_pipeline.figures import TTT_ESTIMATE, WALKED_CHAIN_TAU, fmt
from eagle3_pipeline.model.layer_init import init_layer_from_verifier
from eagle3_pipeline.verifier.loading import read_embedding_tensors, read_layer_tensors

OFFLOAD_EMBEDDING_BYTES = 1 << 28  # as scripts/lab/bench_train_step.py's "auto": embeddings of 256 MB and more


def build_drafter(args, inputs: Inputs, tensors: dict, device: str, dtype, log):
    """A new drafter (embedding and lm_head rows from the verifier, its shape changed by --drafter-config, its
    layer from the verifier's last with --init-from-verifier-layer), or the --finetune-from one."""
    if args.finetune_from:
        return load_drafter(args.finetune_from, embed=tensors["embed_tokens"], device=device, dtype=dtype)
    with torch.device(device):
        model = Eagle3Drafter(inputs.drafter_config())
    model.init_from_verifier(tensors["embed_tokens"], tensors["lm_head"], inputs.mapping.d2t, inputs.mapping.t2d)
    if args.init_from_verifier_layer:
        layer = inputs.verifier.num_layers - 1
        init_layer_from_verifier(model, read_layer_tensors(args.model_path, layer))
        log.info("--init-from-verifier-layer: the drafter's layer starts from the verifier's layer %d", layer)
    return cast_parameters(model, dtype)


def report_vocab_of_finetuned(args, model, inputs: Inputs, log) -> None:
    """A --finetune-from drafter keeps its own draft vocabulary: its lm_head rows belong to it."""
    if not args.finetune_from:
        return
    theirs = set((torch.arange(len(model.d2t)) + model.d2t.cpu()).tolist())
    ours = set(inputs.mapping.draft_ids.tolist())
    if theirs != ours:
        log.warning("--finetune-from %s keeps its own draft vocabulary (its lm_head rows are trained for it); "
                    "%d of its %d tokens are not in the map of %s built from this data", args.finetune_from,
                    len(theirs - ours), len(theirs), inputs.vocab_dir)


def count_parameters(inputs: Inputs) -> int:
    """Trainable parameters of a new drafter, counted on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = Eagle3Drafter(inputs.drafter_config())
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class CurvesAfterValidation:
    """A step hook that redraws training_curves.png after each validation, so a long run's curves are current."""

    def __init__(self, output_dir: Path, title: str, log):
        self.png, self.title, self.log, self.seen = output_dir / CURVES_FILE, title, log, None
        remove_stale_drawings(self.png)

    def __call__(self, trainer) -> None:
        if trainer.last_eval is not None and trainer.last_eval is not self.seen:
            self.seen = trainer.last_eval
            self.draw(trainer, quiet=True)

    def draw(self, trainer, quiet: bool = False) -> None:
        write_training_curves(trainer.metrics.path, self.png, self.title, None if quiet else self.log)


def train_drafter(args, log, inputs: Inputs, run_config: dict, resume_from: Path | None, device: str, rank,
                  hooks) -> None:
    """Train on this rank (inside its process group) from the checked inputs, writing the stage's manifest;
    `hooks` are called as hook(trainer) after every optimizer step."""
    output_dir = Path(args.output_dir)
    manifest = Manifest(output_dir, STAGE, vars(args))
    if inputs.online:  # the states' description stands in for stage 02's manifest
        manifest.add_input("prepared_data", args.prepared_data, Path(args.prepared_data).parent / MANIFEST)
        manifest.data["states"] = {key: value for key, value in inputs.data_manifest.items() if key != "inputs"}
    else:
        manifest.add_input("hidden_states", inputs.data_dir, inputs.data_dir / MANIFEST)
    manifest.add_input("vocab_mapping", inputs.vocab_dir, inputs.vocab_dir / MANIFEST)
    if args.finetune_from:
        manifest.add_input("finetune_from", args.finetune_from, Path(args.finetune_from) / MANIFEST)
    manifest.data["verifier"] = inputs.verifier.identity()
    manifest.data["verifier_weights"] = inputs.data_manifest.get("verifier_weights")  # stage 05 compares it
    manifest.data.update(aux_layers=inputs.aux_layers, draft_vocab_size=len(inputs.mapping.d2t),
                         resumed_from=str(resume_from) if resume_from else None, world_size=rank.world_size,
                         parallelism=("fsdp" if args.fsdp else "ddp") if rank.distributed else None)
    if rank.is_main:
        manifest.write()

    states = load_online_states(args, inputs, device, run_config["compute_dtype"], log) if inputs.online else None
    seed_everything(args.seed)  # the same on every rank: the same initial drafter (after the verifier's load)
    log.info("reading embed_tokens and lm_head of %s%s", args.model_path,
             "" if inputs.online else " (the verifier itself is not loaded)")
    tensors = read_embedding_tensors(args.model_path)
    compute_dtype = run_config["compute_dtype"]
    dtype = getattr(torch, compute_dtype)
    model = build_drafter(args, inputs, tensors, device, dtype, log)
    report_vocab_of_finetuned(args, model, inputs, log)
    if inputs.drafter_overrides and not args.finetune_from:
        log.info("--drafter-config: the drafter's %s set to %s", ", ".join(inputs.drafter_overrides),
                 ", ".join(repr(value) for value in inputs.drafter_overrides.values()))
    model.ttt_positions = args.ttt_positions
    if args.ttt_positions != "shifted":
        log.warning("--ttt-positions %s: TTT step j keeps the RoPE position of step 0, not the one decoding "
                    "uses (for an A/B only; docs/model.md)", args.ttt_positions)
    if args.loss != "kl":
        log.info("--loss %s: training minimises -log of the acceptance probability; validation still reports "
                 "the soft-CE, comparable with --loss kl runs", args.loss)
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

    train_set, val_set = inputs.split(args.val_ratio, args.seed, args.max_seq_len)
    if rank.is_main:
        write_json_atomic(output_dir / VAL_SPLIT_FILE, {"seed": args.seed, "val_ratio": args.val_ratio,
                                                        "train_samples": len(train_set),
                                                        "val_ids": [str(entry["id"]) for entry in val_set.entries]})

    cfg = TrainConfig(lr=args.lr, scheduler=args.scheduler, warmup_ratio=args.warmup_ratio,
                      max_grad_norm=args.max_grad_norm, grad_accum=args.grad_accum, ttt_steps=args.ttt_steps,
                      ttt_decay=args.ttt_decay, noise_std=args.noise_std, loss=args.loss, device=device,
                      dtype=compute_dtype, fp8=args.fp8)
    loop = LoopConfig(epochs=args.epochs, max_tokens=inputs.max_tokens, max_sequences=inputs.max_sequences,
                      pad_to=inputs.pad_to,
                      num_workers=args.num_workers, seed=args.seed, eval_interval=args.eval_interval,
                      save_interval=args.save_interval, log_interval=args.log_interval)
    parallel = None
    if rank.distributed:
        parallel = make_data_parallel(rank, device, args.fsdp)
    curves = CurvesAfterValidation(output_dir, training_title(args), log) if rank.is_main else None
    profiler = StepProfiler(args.profile_steps, output_dir, device, log) if args.profile_steps and rank.is_main \
        else None
    trainer = Trainer(model, verifier_lm_head, cfg, loop, train_set, val_set, output_dir, args.keep_last,
                      run_config,
                      validate_checkpoint=lambda path: check_drafter_dir(path, data_manifest=inputs.data_manifest,
                                                                         verifier_info=inputs.verifier),
                      is_main=rank.is_main, hooks=[*hooks, *filter(None, [curves, profiler])],
                      parallel=parallel, source=states)
    if resume_from is not None:
        trainer.load_training_state(resume_from)
        log.info("resumed from %s: step %d, epoch %d, %d batches of that epoch done", resume_from,
                 trainer.state.step, trainer.state.epoch + 1, trainer.state.batches_consumed)
    manifest.data["counts"] = {"train_samples": len(train_set), "val_samples": len(val_set),
                               "train_tokens": sum(train_set.lengths()), "optimizer_steps": trainer.total_steps}
    if rank.is_main:
        manifest.write()

    try:
        with full_disk_reported(output_dir, trainer.checkpoint_bytes, "stage 04's output (the run goes on only with "
                                "room for a checkpoint)", trainer.checkpoints.whole_so_far()):
            result = trainer.fit()
    finally:  # the curves also for a run stopped by a signal or a failure, up to its last metrics line
        if curves is not None:
            curves.draw(trainer)
        if states is not None:
            states.close()
    if not rank.is_main:
        return
    manifest.data.update(best=result.get("best"), best_val_sim_accept_len=result.get("best_value"),
                         latest=trainer.checkpoints.pointer_target("latest"), last_eval=result.get("last_eval"))
    manifest.complete()
    last = result.get("last_eval") or {}
    log.info("training done: %d steps; the last validation's %s %s (the figure to compare with stage 05's tau); "
             "best checkpoint %s (the highest validation %s, %s); serve it with --speculative-draft-model-path %s",
             trainer.state.step, WALKED_CHAIN_TAU, fmt(last.get("sim_chain_tau")), result.get("best"), TTT_ESTIMATE,
             fmt(result.get("best_value")), output_dir / "best")

