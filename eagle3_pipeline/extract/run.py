"""Stage 02 from checked inputs to a finished output folder: the manifest, the resume and disk checks, the run on
either backend, and the index and manifest at the end."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_pipeline import distributed
from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.progress import Progress
from eagle3_pipeline.extract.config import ExtractionConfig, OutputSettings
from eagle3_pipeline.extract.extractor import Extractor, merge_rank_stats
from eagle3_pipeline.extract.output import (check_writable, owned_entries, remove_owned, resume_key,
    scan_output, tree_bytes)
from eagle3_pipeline.extract.plan import padding_stats, plan_batches, rank_batches
from eagle3_pipeline.extract.writer import DISK_FULL_FIX
from eagle3_pipeline.formats.disk_full import full_disk_reported
from eagle3_pipeline.formats.files import sha256_file
from eagle3_pipeline.formats.hidden_states import (AUX_FILES, FINAL_FILE, FORMAT_VERSION, INDEX_FILE, META_FILE,
    SHARD_SIZE, STAGE, describe_states, estimate_disk_bytes, human_bytes, write_index)
from eagle3_pipeline.formats.manifest import MANIFEST, Manifest
from eagle3_pipeline.formats.storage import StorageFormat, format_of_manifest
from eagle3_pipeline.formats.resume import earlier_manifest, refuse_other_settings, setting_differences
from eagle3_pipeline.formats.prepared_data import Sample
from eagle3_pipeline.verifier.capture import find_text_model
from eagle3_pipeline.verifier.fingerprint import weights_fingerprint
from eagle3_pipeline.verifier.loading import choose_device_map, load_verifier_model, resolve_model_path

UPSTREAM = "01_prepare_data"
DEFAULT_BATCH_SIZE = {"cuda": 64, "cpu": 8}
DEFAULT_MAX_TOKENS_PER_BATCH = {"cuda": 32768, "cpu": 4096}
DISK_MARGIN = 1024 ** 3  # keep 1 GB free for logs, checkpoints and everything else on the disk


@dataclass
class ExtractionInputs:
    """What the stage checked before anything is written: the verifier and the prepared data."""
    info: object  # eagle3_pipeline.verifier.loading.VerifierInfo
    aux_layers: list[int]
    device: str
    compute_dtype: str
    samples: list[Sample]


def verifier_resolved_path(model_path: str) -> str:
    folder, gguf_file = resolve_model_path(model_path)
    path = Path(folder, gguf_file) if gguf_file else Path(folder)
    return str(path.resolve()) if path.exists() else model_path


def check_kept_sample(output_dir: Path, sample: Sample, hidden_size: int, dtype: str,
                      storage: StorageFormat) -> None:
    """--rebuild-manifest: one kept sample must have the shape, dtype and files these flags give, and the same
    tokens."""
    folder = output_dir / sample.rel_path
    stored = torch.load(folder / AUX_FILES[0], map_location="cpu", weights_only=True, mmap=True)
    meta = torch.load(folder / META_FILE, map_location="cpu", weights_only=True)
    expected = (sample.num_tokens, hidden_size)
    aux_dtype = storage.fields(hidden_size)[0][2]
    if tuple(stored.shape) != expected or stored.dtype != aux_dtype or \
            any(not (folder / name).is_file() for name in storage.files()) or \
            not torch.equal(meta["input_ids"], sample.input_ids):
        raise UsageError(f"--rebuild-manifest: {folder} holds {tuple(stored.shape)} {stored.dtype} for other tokens or "
                         f"settings than these flags give ({expected} {dtype}); the samples there were not made with "
                         f"these flags. Use the flags they were made with, or --overwrite")


def build_manifest(config: ExtractionConfig, info, upstream_dir: Path, data_sha, aux_layers,
                   compute_dtype) -> Manifest:
    storage = config.storage_format(info.vocab_size)
    model_path = config.verifier.model_path
    manifest = Manifest(config.output.output_dir, STAGE, config.recorded_flags)
    manifest.add_input("prepared_data", config.output.prepared_data, upstream_dir / MANIFEST)
    manifest.data["inputs"]["prepared_data"]["sha256"] = data_sha
    # stages 04 and 05 compare the weights' fingerprint
    manifest.data.update(describe_states(info, weights_fingerprint(model_path), aux_layers, config.verifier.dtype,
                                         compute_dtype, storage))
    manifest.data.update({
        "format_version": FORMAT_VERSION,
        "backend": config.backend,
        "verifier_resolved_path": verifier_resolved_path(model_path),
        "files": {"aux": list(AUX_FILES), "final": FINAL_FILE, "meta": META_FILE} if storage.targets == "final"
        and not storage.fp8 else {"sample": list(storage.files())},
        "tensor_shape": "[num_tokens, hidden_size]",
        "shard_size": SHARD_SIZE,
        "index": INDEX_FILE,
    })
    return manifest


def check_existing_output(output: OutputSettings, output_dir: Path, manifest: Manifest, log) -> dict | None:
    """The earlier run's manifest when resuming it; refuses results made with other settings."""
    if output.rebuild_manifest:
        log.warning("--rebuild-manifest: keeping the whole samples in %s as made with these flags; the manifest "
                    "and index are written anew", output_dir)
        return None
    existing = earlier_manifest(output_dir, STAGE, output.overwrite, "or --rebuild-manifest to keep every whole "
                                "sample (extracted with these same flags) and write a new manifest")
    if output.overwrite:
        return None
    if existing is None:
        if owned_entries(output_dir):
            raise UsageError(f"--output-dir {output_dir} holds shard folders but no {MANIFEST}, so their origin is "
                             f"unknown; pass --rebuild-manifest to keep them (if they were extracted with these "
                             f"same flags), --overwrite to replace them, or choose another --output-dir")
        return None
    earlier, now = resume_key(existing), resume_key(manifest.data)
    if earlier["verifier_weights"] is None or now["verifier_weights"] is None:  # made before fingerprints, or
        earlier["verifier_weights"] = now["verifier_weights"] = None          # no weight files here to hash
    refuse_other_settings(f"--output-dir {output_dir} holds hidden states", setting_differences(earlier, now),
                          "They cannot be resumed: pass --overwrite to replace them, or choose another --output-dir.")
    return existing


def check_disk(output: OutputSettings, storage: StorageFormat, output_dir: Path, todo_tokens: int,
               todo_samples: int, info, log) -> int:
    needed = estimate_disk_bytes(todo_tokens, todo_samples, info.hidden_size, 0, storage)
    free = shutil.disk_usage(output_dir).free
    if output.overwrite:  # what --overwrite is about to delete will be free again
        free += sum(tree_bytes(p) for p in owned_entries(output_dir))
    log.info("disk: this run writes about %s (%d tokens x %d bytes: aux %s, targets %s; plus metadata); %s free at "
             "%s", human_bytes(needed), todo_tokens, storage.bytes_per_token(info.hidden_size), storage.aux_dtype,
             storage.targets, human_bytes(free), output_dir)
    if needed + DISK_MARGIN > free:
        message = (f"--output-dir {output_dir}: the run needs about {human_bytes(needed)} (+{human_bytes(DISK_MARGIN)} "
                   f"margin) but only {human_bytes(free)} is free. Free space, choose another --output-dir, "
                   f"use fewer samples, --aux-dtype float8_e4m3 or --targets topk (smaller formats), or pass "
                   f"--allow-low-disk to try anyway")
        if not output.allow_low_disk:
            raise UsageError(message)
        log.warning("%s (continuing: --allow-low-disk)", message)
    return needed


def finish_output(output_dir: Path, samples, manifest: Manifest, summary: dict, log) -> None:
    """6. Index and manifest over everything on disk (this run plus earlier ones), for either backend."""
    complete = scan_output(output_dir, samples, clean=False)
    skipped = summary.get("skipped_nonfinite") or {}  # --skip-nonfinite: left out on purpose
    if len(complete) + len(skipped) != len(samples):
        raise RuntimeError(f"{len(samples) - len(complete)} samples are missing after the run; rerun to resume")
    if skipped:
        log.warning("--skip-nonfinite: %d samples with NaN/inf hidden states were left out: %s", len(skipped),
                    ", ".join(f"{sample_id!r} (from {where})" for sample_id, where in list(skipped.items())[:20]))
        kept = [samples[i] for i in complete]  # the counts describe what the index lists
        manifest.data["counts"].update({"samples": len(kept), "tokens": sum(s.num_tokens for s in kept),
                                        "loss_tokens": int(sum(int(s.loss_mask.sum()) for s in kept)),
                                        "skipped_nonfinite": len(skipped)})
    write_index(output_dir, samples, complete)
    manifest.data["counts"]["files"] = len(complete) * len(format_of_manifest(manifest.data, STAGE).files())
    manifest.data["last_run"] = summary
    manifest.complete()
    log.info("wrote %s and %s", output_dir / "index.jsonl", output_dir / MANIFEST)


def extract_hidden_states(config: ExtractionConfig, inputs: ExtractionInputs, rank: distributed.RankInfo,
                          log) -> None:
    """Steps 3-6 of stage 02: claim and check the output folder, plan, run the backend, finish the output."""
    info, aux_layers, device, compute_dtype, samples = (inputs.info, inputs.aux_layers, inputs.device,
                                                        inputs.compute_dtype, inputs.samples)
    output, verifier = config.output, config.verifier
    data_file = Path(output.prepared_data)
    data_sha = sha256_file(data_file)

    # 3. The output folder: writable, not in use, and either empty, resumable, or --overwrite.
    output_dir = Path(output.output_dir)
    check_writable(output_dir)
    # (the folder's lock is held by eagle3_pipeline.cli.stage.run_stage, on rank 0 for all ranks)
    manifest = build_manifest(config, info, data_file.parent, data_sha, aux_layers, compute_dtype)
    storage = config.storage_format(info.vocab_size)
    existing = check_existing_output(output, output_dir, manifest, log)
    device_kind = "cpu" if device == "cpu" else "cuda"
    batch_size = config.batches.batch_size or DEFAULT_BATCH_SIZE[device_kind]
    max_tokens = config.batches.max_tokens_per_batch or DEFAULT_MAX_TOKENS_PER_BATCH[device_kind]
    batches = plan_batches(samples, batch_size, max_tokens)
    complete = set() if output.overwrite else distributed.from_main(
        lambda: scan_output(output_dir, samples, clean=False))  # one scan, the same on every rank
    todo_batches = [b for b in batches if any(i not in complete for i in b)]
    todo_samples = [i for i in range(len(samples)) if i not in complete]
    todo_tokens = sum(samples[i].num_tokens for i in todo_samples)
    total_tokens = sum(s.num_tokens for s in samples)
    counts = {"samples": len(samples), "tokens": total_tokens,
              "loss_tokens": int(sum(int(s.loss_mask.sum()) for s in samples)),
              "truncated_samples": sum(s.truncated for s in samples)}
    manifest.data["counts"] = dict(counts)

    if output.rebuild_manifest and complete:
        check_kept_sample(output_dir, samples[min(complete)], info.hidden_size, verifier.dtype, storage)
    if (existing is not None or output.rebuild_manifest) and not todo_samples:
        if existing is not None and existing.get("status") == "complete":
            log.info("%s already holds all %d samples (%d tokens) extracted with these settings; nothing to do "
                     "(pass --overwrite to extract again)", output_dir, len(samples), total_tokens)
            return
        if rank.is_main:
            write_index(output_dir, samples, complete)  # killed after the last sample, before finishing
            manifest.complete()
        log.info("all %d samples were already on disk; manifest completed", len(samples))
        return
    if existing is not None:
        log.info("resuming: %d of %d samples are complete; %d samples (%d tokens) to go", len(complete),
                 len(samples), len(todo_samples), todo_tokens)

    # 4. The SGLang capture's GPU memory and the disk, then (only now) clear an overwritten output.
    if config.backend == "sglang":
        from eagle3_pipeline.extract.sglang_backend import plan_capture_memory

        memory = plan_capture_memory(config, info, samples, aux_layers, max_tokens, log)
    needed = check_disk(output, storage, output_dir, todo_tokens, len(todo_samples), info, log)
    distributed.barrier()  # every rank has read the output folder before rank 0 changes it
    if output.overwrite and rank.is_main:
        removed = remove_owned(output_dir)
        if removed:
            log.info("--overwrite: removed %d earlier entries from %s", removed, output_dir)
    if rank.is_main:
        scan_output(output_dir, samples, clean=True)  # drop temp folders and partial samples of a killed run
    pad = padding_stats(samples, todo_batches)
    log.info("plan: %d batches (<= %d sequences, <= %d padded tokens each), padding waste %.1f%%",
             len(todo_batches), batch_size, max_tokens, 100 * pad["padding_waste"])
    manifest.data["planned_bytes"] = needed
    if rank.is_main:
        manifest.write()
    if rank.distributed:
        distributed.barrier()  # cleaned up before any rank writes a sample
        todo_batches = rank_batches(samples, todo_batches, rank.world_size, rank.rank)
        todo_samples = [i for batch in todo_batches for i in batch if i not in complete]
        log.info("%d ranks; rank 0 extracts %d batches (%d samples)", rank.world_size, len(todo_batches),
                 len(todo_samples))

    if config.backend == "sglang":  # SGLang's processes run the verifier; patches/sglang_capture.py writes
        from eagle3_pipeline.extract.sglang_backend import SGLangRunFailed, extract_with_sglang

        try:
            summary = extract_with_sglang(config, info, samples, todo_samples, complete, aux_layers, output_dir,
                                          batch_size, max_tokens, log, memory)
        except SGLangRunFailed as failure:  # the samples on disk stay; the manifest says why and how to resume
            manifest.fail(failure.details)
            raise
        log.info("extracted %d samples (%d tokens) in %.1f s: %.0f tokens/s, about %s written",
                 summary["samples_written"], summary["tokens_written"], summary["elapsed_s"],
                 summary["tokens_per_s"], human_bytes(summary["bytes_written"]))
        finish_output(output_dir, samples, manifest, summary, log)
        return

    # 5. Writers first (forked without a model), then the verifier, then the batches.
    with Extractor(output_dir, samples, batches, aux_layers, info.hidden_size, getattr(torch, verifier.dtype),
                   config.batches.num_workers, skip_nonfinite=output.skip_nonfinite, storage=storage) as extractor:
        device_map = choose_device_map(verifier.model_path, device, verifier.device_map)
        log.info("loading the verifier%s ...", " sharded over the visible GPUs" if device_map else f" on {device}")
        started = time.time()
        model = load_verifier_model(verifier.model_path, device, compute_dtype, verifier.trust_remote_code,
                                    device_map)
        text = find_text_model(model, info.num_layers)
        embedding = text.base.get_input_embeddings() if hasattr(text.base, "get_input_embeddings") else None
        width = getattr(embedding, "embedding_dim", info.hidden_size)
        if width != info.hidden_size:
            raise RuntimeError(f"the text model found at {text.name} has hidden size {width}, but the config "
                               f"says {info.hidden_size}; this architecture needs support in "
                               f"eagle3_pipeline/verifier/capture.find_text_model")
        log.info("verifier loaded in %.0f s; text model at %s", time.time() - started, text.name)
        if getattr(model, "hf_device_map", None) and {"cpu", "disk"} & set(map(str, model.hf_device_map.values())):
            log.warning("parts of the verifier were placed on cpu/disk: extraction will be very slow")
        with Progress(total=len(todo_samples), desc="extract", unit="samples") as progress:
            # index.jsonl grows during the run (run_pipeline.py --status reads it for progress)
            def refresh(written):  # (rank 0 only: the others' samples join the index at the end)
                write_index(output_dir, samples, complete | written)

            with full_disk_reported(output_dir, needed, "stage 02's output", DISK_FULL_FIX):  # (index.jsonl too)
                stats = extractor.run(text, todo_batches, complete, progress,
                                      on_checkpoint=refresh if rank.is_main else None)
    summary = stats.as_dict()
    log.info("extracted %d samples (%d tokens) in %.1f s: %.0f tokens/s, %s written (%s/s), padding waste %.1f%%",
             summary["samples_written"], summary["tokens_written"], summary["elapsed_s"], summary["tokens_per_s"],
             human_bytes(summary["bytes_written"]), human_bytes(summary["write_bytes_per_s"]),
             100 * summary["padding_waste"])

    if rank.distributed:  # once every rank has reported, all their samples are on disk
        summary = merge_rank_stats(distributed.all_gather_object(summary))
        if rank.is_main:
            log.info("all %d ranks: %d samples (%d tokens) in %.1f s: %.0f tokens/s", rank.world_size,
                     summary["samples_written"], summary["tokens_written"], summary["elapsed_s"],
                     summary["tokens_per_s"])
            finish_output(output_dir, samples, manifest, summary, log)
        # Every rank leaves the group together: a rank that left while rank 0 still wrote once aborted at exit
        # under load ("terminate called without an active exception").
        distributed.barrier()
        distributed.shutdown()
        return

    finish_output(output_dir, samples, manifest, summary, log)
