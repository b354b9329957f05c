"""--mode eval: teacher-forced scores of a drafter on the validation split of stage 02's hidden states."""
from __future__ import annotations

import time
from pathlib import Path

from eagle3_pipeline.bench.drafter_check import check_drafter
from eagle3_pipeline.figures import TTT_ESTIMATE, WALKED_CHAIN_TAU, fmt
from eagle3_pipeline.bench.settings import STAGE, BenchConfig, recorded_settings
from eagle3_pipeline.errors import UsageError, require
from eagle3_pipeline.progress import Progress
from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.formats.manifest import MANIFEST


def validation_entries(draft_dir: Path, entries: list[dict], log) -> tuple[list[dict], str]:
    """The samples training held out (val_split.json beside the checkpoints), else all with a warning."""
    resolved = draft_dir.resolve()
    for folder in (resolved, resolved.parent, draft_dir.parent):
        split_file = folder / "val_split.json"
        if split_file.is_file():
            val_ids = {str(i) for i in read_json(split_file).get("val_ids", [])}
            chosen = [e for e in entries if str(e["id"]) in val_ids]
            if chosen:
                log.info("evaluating on the %d validation samples training held out (%s)", len(chosen), split_file)
                return chosen, f"validation split ({split_file})"
            log.warning("%s names no sample of this hidden-state index: evaluating on all %d samples",
                        split_file, len(entries))
            return entries, "all samples (validation ids not in this index)"
    log.warning("no val_split.json beside %s: evaluating on all %d samples, which may include training data",
                draft_dir, len(entries))
    return entries, "all samples (no validation split recorded)"


def run_eval(config: BenchConfig, log, begin, *_ignored) -> dict:
    """Score the drafter teacher-forced on stored hidden states; the results of --mode eval."""
    import torch
    from eagle3_pipeline.formats.layer_ids import aux_layers_from_eagle_config
    from eagle3_pipeline.model.checkpoint import load_drafter
    from eagle3_pipeline.formats.hidden_states import load_sample, open_hidden_states
    from eagle3_pipeline.train.parameters import compute_dtype_for
    from eagle3_pipeline.train.step import evaluate
    from eagle3_pipeline.verifier.loading import pick_device, read_embedding_tensors, read_verifier_info

    verifier, inputs, decoding = config.verifier, config.inputs, config.decoding
    require(inputs, "data_dir", "draft_model_path")
    data_dir = Path(inputs.data_dir)
    manifest, entries = open_hidden_states(data_dir)
    model_path = verifier.model_path or (manifest.get("verifier") or {}).get("path")
    if not model_path:
        raise UsageError(f"{data_dir / MANIFEST} names no verifier; give --model-path (its lm_head scores the drafter)")
    info = read_verifier_info(model_path, verifier.trust_remote_code)
    drafter_config = check_drafter(config, info, log)
    # The drafter's config names SGLang ids (whose meaning depends on the verifier); compare as HF indices.
    sglang_ids = (drafter_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    drafter_layers = aux_layers_from_eagle_config(sglang_ids, info.architecture) if sglang_ids else None
    stored_layers = [int(x) for x in manifest.get("aux_layers") or []] or None
    log.info("hidden states %s: inputs of layers %s; the drafter reads layers %s", data_dir, stored_layers,
             drafter_layers)
    if stored_layers and drafter_layers and stored_layers != drafter_layers:
        raise UsageError(f"--draft-model-path {inputs.draft_model_path} reads the inputs of layers {drafter_layers} "
                         f"but --data-dir {data_dir} stores layers {stored_layers}: evaluate the drafter on "
                         f"hidden states of its own layers")
    if not entries:
        raise UsageError(f"--data-dir {data_dir}: the index lists no complete sample; rerun 02_extract_hidden_states.py")
    entries, split = validation_entries(Path(inputs.draft_model_path), entries, log)
    if inputs.num_prompts and inputs.num_prompts > len(entries):
        log.warning("--num-prompts %d: there are only %d samples (%s); all of them are evaluated",
                    inputs.num_prompts, len(entries), split)
    if inputs.num_prompts:
        entries = entries[:inputs.num_prompts]
    begin()

    device = pick_device(verifier.device)
    tensors = read_embedding_tensors(model_path)
    # The drafter computes in its parameters' dtype, as training validates it (--dtype on GPU, float32 on CPU).
    dtype = getattr(torch, compute_dtype_for(device, verifier.dtype))
    drafter = load_drafter(inputs.draft_model_path, embed=tensors["embed_tokens"], device=device, dtype=dtype)
    lm_head = tensors["lm_head"].to(device=device, dtype=dtype)
    started = time.time()
    with Progress(len(entries), "05_benchmark eval", unit="sample") as progress:
        def samples():
            for entry in entries:
                yield load_sample(str(data_dir), entry)
                progress.update(1)
        # The walk stops where decoding with the same budget would, so its tau compares with --mode offline's.
        metrics = evaluate(drafter, samples(), lm_head, decoding.num_steps, device=device,
                           chain_max_new_tokens=decoding.max_new_tokens)
    seconds = time.time() - started
    return {"mode": "eval", "stage": STAGE, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": recorded_settings(config, {"model_path": model_path, "ttt_steps": decoding.num_steps,
                                                   "samples": len(entries), "split": split, "device": str(device),
                                                   "compute_dtype": str(dtype)}),
            "metrics": metrics, "seconds": seconds}


def eval_summary_line(results: dict) -> str:
    """The one-line SUMMARY of --mode eval: the walked chain tau, the TTT acceptance estimate, per-step agreement."""
    metrics = results["metrics"]
    walked = results["settings"].get("max_new_tokens")
    return (f"{WALKED_CHAIN_TAU} {fmt(metrics.get('sim_chain_tau'))} (3 drafts, over each reply's first {walked} "
            f"tokens) | {TTT_ESTIMATE} {fmt(metrics['sim_accept_len'])} | top-1 agreement per step "
            f"[{', '.join(fmt(a, 3) for a in metrics['acc_per_step'])}] | {metrics['tokens']} tokens in "
            f"{results['seconds']:.1f} s")
