"""One SpecForge-recipe training run on a run directory of ours: the settings taken from our stage-04 run,
the same training samples, the loop over epochs (one sequence per step, as SpecForge trains), the export to
our checkpoint format and the results file. scripts/lab/train_specforge_recipe.py is its command line."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.progress import Progress
from eagle3_pipeline.formats.files import read_json, write_json_atomic, write_text_atomic
from eagle3_pipeline.formats.hidden_states import load_sample, open_hidden_states
from eagle3_pipeline.formats.manifest import MANIFEST, Manifest
from eagle3_pipeline.formats.vocab_map import load_mapping
from eagle3_pipeline.peer.specforge import SPECFORGE_DEFAULTS, SPECFORGE_VERSION, RecipeSettings

STAGE = "specforge_recipe"
RESULTS_FILE = "specforge_results.json"
# Our stage-04 flags the SpecForge run takes over (ours -> SpecForge's name); everything else is SpecForge's default.
TAKEN_FROM_OURS = {"epochs": "epochs", "lr": "lr", "seed": "seed", "max_seq_len": "max_length",
                   "ttt_steps": "ttt_steps"}


@dataclass
class RunPlan:
    data_dir: Path
    data_manifest: dict
    train_entries: list[dict]
    mapping: object  # eagle3_pipeline.formats.vocab_map.VocabMapping
    settings: RecipeSettings
    sources: dict  # setting -> "our stage 04 run" | "SpecForge default" | "command line"
    ours: dict = field(default_factory=dict)  # our stage-04 run's figures, for the comparison


def plan_run(run_dir: Path, checkpoints_dir: Path, overrides: dict, device_type: str) -> RunPlan:
    """What to train on and how: stage 02's samples minus our validation ids, the settings of our stage-04
    run where it has one (else SpecForge's defaults), then the command line's overrides."""
    data_dir = run_dir / "hidden_states"
    for folder, stage in ((data_dir, "02_extract_hidden_states.py"), (run_dir / "vocab", "03_build_vocab_mapping.py")):
        if not (folder / MANIFEST).is_file():
            raise UsageError(f"--run-dir {run_dir}: no {folder.name}/{MANIFEST}; run {stage} on it first")
    data_manifest, entries = open_hidden_states(data_dir)
    if (data_manifest.get("storage") or {}).get("targets", "final") != "final" or \
            (data_manifest.get("storage") or {}).get("aux_dtype") == "float8_e4m3":
        raise UsageError(f"--run-dir {run_dir}: its hidden states are stored as "
                         f"{data_manifest['storage']['aux_dtype']} aux with {data_manifest['storage']['targets']} "
                         f"targets; SpecForge's recipe reads bf16 aux and final only (stage 02's default format)")
    entries = [e for e in entries if int(e.get("loss_tokens", 1)) > 0]  # as stage 04 keeps them
    mapping = load_mapping(run_dir / "vocab")
    values = {"epochs": SPECFORGE_DEFAULTS["epochs"], "lr": SPECFORGE_DEFAULTS["lr"],
              "seed": SPECFORGE_DEFAULTS["seed"], "max_length": SPECFORGE_DEFAULTS["max_length"],
              "ttt_steps": SPECFORGE_DEFAULTS["ttt_steps"], "dtype": SPECFORGE_DEFAULTS["dtype"],
              "attention_backend": "flex_attention" if device_type == "cuda" else "sdpa",
              "wrap": device_type == "cuda"}
    sources = {name: "SpecForge default" for name in values}
    sources["attention_backend"] = ("SpecForge default" if device_type == "cuda"
                                    else "sdpa on CPU (flex_attention has no CPU backward)")
    sources["wrap"] = "FSDP as `specforge train` (one GPU)" if device_type == "cuda" else "no FSDP on CPU"
    ours: dict = {}
    val_ids: set[str] = set()
    manifest_path = checkpoints_dir / MANIFEST
    if manifest_path.is_file():
        manifest = read_json(manifest_path)
        flags = manifest.get("flags") or {}
        for our_name, their_name in TAKEN_FROM_OURS.items():
            if flags.get(our_name) is not None:
                values[their_name] = type(values[their_name])(flags[our_name])
                sources[their_name] = "our stage 04 run"
        split = read_json(checkpoints_dir / "val_split.json") if (checkpoints_dir / "val_split.json").is_file() else {}
        val_ids = {str(i) for i in split.get("val_ids", [])}
        ours = {"status": manifest.get("status"), "wall_time_s": manifest.get("wall_time_s"),
                "counts": manifest.get("counts"), "best": manifest.get("best"),
                "best_val_sim_accept_len": manifest.get("best_val_sim_accept_len"),
                "max_tokens_per_batch": flags.get("max_tokens_per_batch"), "val_ratio": flags.get("val_ratio")}
    for name, value in overrides.items():
        if value is not None:
            values[name], sources[name] = value, "command line"
    train = [e for e in entries if str(e["id"]) not in val_ids]
    if not train:
        raise UsageError(f"{data_dir}: no training samples left after our validation split")
    return RunPlan(data_dir, data_manifest, train, mapping, RecipeSettings(**values), sources, ours)


class RecipeSamples(Dataset):
    """Stage-02 samples as SpecForge's TrainBatch (normalised in the loader's workers)."""

    def __init__(self, data_dir: Path, entries: list[dict], make_batch):
        self.data_dir, self.entries, self.make_batch = data_dir, entries, make_batch

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, position: int):
        entry = self.entries[position]
        return self.make_batch(str(entry["id"]), load_sample(self.data_dir, entry))


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """A seeded shuffle per epoch, as torch's DistributedSampler (seed + epoch) gives SpecForge's loader."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(count, generator=generator).tolist()


def train(recipe, plan: RunPlan, num_workers: int, log, time_limit_s: float | None = None,
          max_steps: int | None = None) -> dict:
    """All epochs, one sample per step; returns the training record (steps, tokens, wall time, metrics)."""
    dataset = RecipeSamples(plan.data_dir, plan.train_entries, recipe.batch_maker())
    settings = plan.settings
    steps_total = min(recipe.total_steps, max_steps or recipe.total_steps)  # what this run will do
    history: list[dict] = []
    tokens = 0
    stopped = None
    cuda = recipe.device.type == "cuda"
    started = time.perf_counter()
    with Progress(steps_total, "SpecForge recipe", unit="step") as progress:
        for epoch in range(settings.epochs):
            loader = DataLoader(dataset, sampler=epoch_order(len(dataset), settings.seed, epoch),
                                batch_size=None, num_workers=num_workers,
                                prefetch_factor=4 if num_workers > 0 else None)
            for batch in loader:
                metrics = recipe.train_step(batch)
                length = int(batch.tensors["input_ids"].shape[1])
                tokens += length
                history.append({"step": recipe.global_step, "epoch": epoch + 1, "tokens": length, **metrics})
                progress.update(1, f"loss {metrics.get('loss', float('nan')):.3f} "
                                   f"acc0 {metrics.get('acc_0', float('nan')):.3f}")
                if recipe.global_step >= recipe.total_steps:
                    continue  # the whole plan is done (the last sample of the last epoch)
                if recipe.global_step >= steps_total:
                    stopped = "max_steps"
                elif time_limit_s is not None and time.perf_counter() - started > time_limit_s:
                    stopped = "time_limit"
                if stopped:
                    break
            if stopped:
                break
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    if stopped == "time_limit":
        log.warning("--time-limit reached after %d of %d steps: the drafter is exported as it is (%s)",
                    recipe.global_step, recipe.total_steps, "not comparable to a full run")
    return {"steps": recipe.global_step, "planned_steps": recipe.total_steps, "tokens": tokens,
            "wall_time_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
            "stopped_early": stopped, "epochs_completed": history[-1]["epoch"] if history else 0,
            "final_train": summarize(history[-min(len(history), 200):]), "history": history}


def summarize(window: list[dict]) -> dict:
    """Token-weighted mean of each metric over the last steps (per-step acc_j is noisy at batch 1)."""
    if not window:
        return {}
    keys = [k for k in window[-1] if k.startswith(("acc_", "ploss_")) or k in ("acc", "loss")]
    weight = sum(r["tokens"] for r in window)
    return {"steps": len(window), **{k: round(sum(r.get(k, 0.0) * r["tokens"] for r in window) / weight, 5)
                                     for k in keys}}


def write_manifest(output_dir: Path, plan: RunPlan, flags: dict) -> Manifest:
    """A manifest naming the hidden states, so stage 05 traces the drafter's training prompts from it."""
    manifest = Manifest(output_dir, STAGE, flags)
    manifest.add_input("hidden_states", plan.data_dir, plan.data_dir / MANIFEST)
    manifest.data["specforge_version"] = SPECFORGE_VERSION
    manifest.write()
    return manifest


def write_results(output_dir: Path, record: dict) -> Path:
    """specforge_results.json (atomically)."""
    path = output_dir / RESULTS_FILE
    write_json_atomic(path, record)
    return path


def drafter_config_for(plan: RunPlan, checkpoints_dir: Path, info):
    """The shape our drafter has (its config.json, with any --drafter-config overrides), else the verifier's."""
    import json

    from eagle3_pipeline.model.config import DrafterConfig

    ours = checkpoints_dir / "best" / "config.json"
    if ours.is_file():
        cfg = DrafterConfig.from_sglang_config(json.loads(ours.read_text()))
    else:
        cfg = DrafterConfig.from_verifier(info, len(plan.mapping.d2t), plan.data_manifest["aux_layers"])
    if cfg.aux_layers != [int(x) for x in plan.data_manifest["aux_layers"]]:
        raise UsageError(f"{ours}: aux layers {cfg.aux_layers} differ from the hidden states' "
                         f"{plan.data_manifest['aux_layers']}; retrain stage 04 on this run")
    return cfg


def run_recipe(args, log):
    """scripts/lab/train_specforge_recipe.py's work: plan, train, export, results. Returns (recipe, results)."""
    from eagle3_pipeline.peer import specforge, specforge_export
    from eagle3_pipeline.verifier.loading import pick_device, read_embedding_tensors, read_verifier_info

    if not specforge.specforge_importable():  # (--specforge-path is on PYTHONPATH: the script saw to it)
        raise UsageError(f"cannot import specforge; install it: {specforge.INSTALL_HINT}")
    run_dir, output_dir = Path(args.run_dir), Path(args.output_dir)
    checkpoints = Path(args.checkpoints_dir) if args.checkpoints_dir else run_dir / "checkpoints"
    device = pick_device(args.device)
    device_type = torch.device(device).type
    overrides = {"epochs": args.epochs, "lr": args.lr, "seed": args.seed, "max_length": args.max_length,
                 "ttt_steps": args.ttt_steps, "dtype": args.dtype, "attention_backend": args.attention_backend}
    plan = plan_run(run_dir, checkpoints, overrides, device_type)
    model_path = args.model_path or (read_json(plan.data_dir / MANIFEST).get("flags") or {}).get("model_path")
    if not model_path:
        raise UsageError(f"{plan.data_dir / MANIFEST} records no model_path; give --model-path")
    info = read_verifier_info(model_path)
    cfg = drafter_config_for(plan, checkpoints, info)
    settings = plan.settings
    for name, source in sorted(plan.sources.items()):
        log.info("SpecForge setting %s = %s (%s)", name, getattr(settings, name), source)

    sf = specforge.import_specforge(device_type)
    total_steps = sf.resolve_total_steps(total_steps=None, max_steps=None, num_samples=len(plan.train_entries),
                                         batch_size=1, accumulation_steps=1, num_epochs=settings.epochs)
    log.info("training on %d samples x %d epochs = %d steps (one sequence each, at most %d tokens)",
             len(plan.train_entries), settings.epochs, total_steps, settings.max_length)
    started = time.perf_counter()
    tensors = read_embedding_tensors(model_path)
    torch.manual_seed(settings.seed)
    recipe = specforge.SpecForgeRecipe(sf, specforge_export.specforge_drafter_config(cfg), tensors["embed_tokens"],
                                       tensors["lm_head"], plan.mapping.d2t, plan.mapping.t2d, settings,
                                       total_steps, device)
    del tensors
    setup_s = time.perf_counter() - started
    manifest = write_manifest(output_dir, plan, vars(args))
    split = checkpoints / "val_split.json"
    if split.is_file():  # beside the drafter, so `05_benchmark.py --mode eval` scores it on the same held-out ids
        write_json_atomic(output_dir / "val_split.json", read_json(split))
    best = output_dir / "best"
    try:
        record = train(recipe, plan, args.num_workers, log, args.time_limit, args.max_steps)
        state = recipe.trained_state()
    finally:
        recipe.close()
    history = record.pop("history")
    write_json_lines(output_dir / "metrics.jsonl", history)
    notes = specforge_export.export_specforge_drafter(
        state, cfg, best,
        extra={"trained_by": f"SpecForge {SPECFORGE_VERSION} recipe (scripts/lab/train_specforge_recipe.py)"},
        data_manifest=plan.data_manifest, verifier_info=info)
    for note in notes:
        log.warning("checkpoint check: %s", note)
    defaults = {k: v for k, v in specforge.SPECFORGE_DEFAULTS.items()
                if plan.sources.get(k, "SpecForge default") == "SpecForge default"}
    results = {"specforge_version": SPECFORGE_VERSION, "device": device, "settings": settings.as_dict(),
               "setting_sources": plan.sources, "specforge_defaults_used": defaults,
               "loss_mask": "stage 02's, through SpecForge's normaliser (row t counts where loss_mask[t] is set; "
                            "its target is token t+2, as with SpecForge's own data)",
               "cpu_substitutions": sf.cpu_substitutions, "train_samples": len(plan.train_entries),
               "drafter": str(best), "num_workers": args.num_workers, "setup_s": round(setup_s, 2), **record,
               # setup + training + export: what our stage 04 manifest's wall_time_s covers (ours also validates)
               "total_s": round(time.perf_counter() - started, 2), "ours": plan.ours}
    path = write_results(output_dir, results)
    write_text_atomic(output_dir / "specforge_results.md", results_markdown(results))
    manifest.data["results"] = {k: v for k, v in results.items() if k != "ours"}
    manifest.complete()
    final = record["final_train"]
    log.info("SUMMARY SpecForge recipe: %d steps, %d tokens in %.1f s (%.0f tokens/s; %.1f s with setup and "
             "export); final train acc per TTT step %s; drafter %s; results %s", record["steps"], record["tokens"],
             record["wall_time_s"], record["tokens_per_s"] or 0, results["total_s"],
             [final.get(f"acc_{j}") for j in range(settings.ttt_steps)], best, path)
    return recipe, results


def write_json_lines(path: Path, rows: list[dict]) -> None:
    import json

    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def results_markdown(results: dict) -> str:
    """specforge_results.md: the settings (and where each came from) and the run's figures."""
    lines = [f"# SpecForge {results['specforge_version']} recipe on {results['device']}", "",
             "| setting | value | from |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {results['setting_sources'].get(k, 'SpecForge default')} |"
              for k, v in results["settings"].items()]
    lines += [f"| {k} | {v} | SpecForge default |" for k, v in results["specforge_defaults_used"].items()
              if k not in results["settings"]]
    final = results["final_train"]
    accs = ", ".join(f"{final[k]:.3f}" for k in sorted(final) if k.startswith("acc_"))
    lines += ["", f"{results['train_samples']} training samples; {results['steps']} of {results['planned_steps']} "
              f"steps, {results['tokens']} tokens in {results['wall_time_s']} s ({results['tokens_per_s']} tokens/s); "
              f"{results['total_s']} s with set-up and export. Training accuracy per TTT step over the last "
              f"{final.get('steps', 0)} steps: {accs}."]
    if results["stopped_early"]:
        lines.append(f"Stopped early ({results['stopped_early']}).")
    if results["cpu_substitutions"]:
        lines.append("CPU substitutions: " + "; ".join(results["cpu_substitutions"]) + ".")
    return "\n".join(lines) + "\n"
