"""Stage 02 with SGLang as the engine (`--backend sglang --tp-size 8`), in the stage's process: preflight, the
capture plan, the engine and its requests, progress. Division of labour and engine settings: docs/extraction.md."""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Sequence

from common.cli.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
PATCH_PACKAGE = "patches"

# Verifier architectures whose text model patches/sglang_capture.py hooks in the pinned SGLang.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaModel",
    "DeepseekV2ForCausalLM": "DeepseekV2Model",
    "DeepseekV3ForCausalLM": "DeepseekV2Model",
    "KimiK25ForConditionalGeneration": "DeepseekV2Model (language_model.model)",
}
CAPTURE_SETTINGS: dict[str, Any] = {
    "disable_radix_cache": True,
    "chunked_prefill_size": -1,
    "enable_mixed_chunk": False,
    "disable_prefill_cuda_graph": True,
    "disable_decode_cuda_graph": True,
    "enable_torch_compile": False,
    "enable_two_batch_overlap": False,
    "enable_single_batch_overlap": False,
    "disable_overlap_schedule": True,
    "attn_dp_size": 1,
    "dp_size": 1,
    "pp_size": 1,
    "enable_attn_tp_input_scattered": False,
    "enable_layernorm_sp": False,
    "skip_tokenizer_init": True,
}
REQUESTS_PER_CALL_FACTOR = 8  # requests per Engine.generate call: this many batches' worth
STALL_TIMEOUT_S = 900.0  # no sample finished for this long after the last request returned: give up
INDEX_REFRESH_S = 60.0


# --- preflight (seconds, before the engine loads) ---------------------------------------------------------------

def check_sglang_installed() -> str:
    """The pinned SGLang is installed (read from its metadata; nothing is imported). Returns its version."""
    from patches import SUPPORTED_SGLANG_VERSION, installed_sglang_version, sglang_version_problem

    installed = installed_sglang_version() if importlib.util.find_spec("sglang") is not None else None
    problem = sglang_version_problem(installed)
    if problem is not None:
        raise UsageError(f"--backend sglang: {problem}")
    return SUPPORTED_SGLANG_VERSION


def check_sglang_early(args) -> str:
    """The --backend sglang checks that need nothing but the flags (before the verifier config is read):
    the pinned SGLang, one process, GPUs for --tp-size. Raises UsageError; returns the SGLang version."""
    version = check_sglang_installed()
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise UsageError("--backend sglang starts its own processes (one per --tp-size GPU): run stage 02 as one "
                         "process, without torchrun")
    if args.device == "cpu" or str(args.device).startswith("cuda:"):
        raise UsageError(f"--device {args.device}: --backend sglang runs on the GPUs SGLang is given "
                         f"(CUDA_VISIBLE_DEVICES and --tp-size); leave --device at auto")
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < args.tp_size:
        raise UsageError(f"--backend sglang --tp-size {args.tp_size} needs {args.tp_size} GPUs, {visible} visible here "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE") not in (None, "", PATCH_PACKAGE):
        raise UsageError(f"SGLANG_EXTERNAL_MODEL_PACKAGE={os.environ['SGLANG_EXTERNAL_MODEL_PACKAGE']} is set; stage "
                         f"02 needs it for its own hooks ({PATCH_PACKAGE}): unset it")
    return version


def check_sglang_verifier(args, info) -> None:
    """The verifier is one whose text model the hooks cover, in a folder SGLang can load."""
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        raise UsageError(f"--backend sglang: the capture hooks cover {', '.join(sorted(SUPPORTED_ARCHITECTURES))}; "
                         f"--model-path {args.model_path} is {info.architecture}. Use --backend hf for it")
    if str(args.model_path).endswith(".gguf"):
        raise UsageError("--backend sglang needs a Hugging Face folder as --model-path, not a GGUF file")


def engine_kwargs(args, model_folder: str, batch_size: int, max_tokens: int) -> dict[str, Any]:
    """sglang.Engine(**kwargs) for extraction: the capture settings plus the stage's own flags."""
    kwargs = dict(CAPTURE_SETTINGS)
    kwargs.update(model_path=model_folder, tp_size=args.tp_size, dtype=args.dtype,
                  trust_remote_code=bool(args.trust_remote_code), mem_fraction_static=args.gpu_memory_utilization,
                  max_running_requests=batch_size, max_prefill_tokens=max_tokens, log_level="info")
    return kwargs


# --- the run -----------------------------------------------------------------------------------------------------

class JournalFollower:
    """Reads the sample positions the hooks append to OUTPUT_DIR/.sglang_written.txt as samples are finished."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.done: set[int] = set()

    def poll(self) -> list[int]:
        if not self.path.exists():
            return []
        with open(self.path) as handle:
            handle.seek(self.offset)
            text = handle.read()
        complete = text[:text.rfind("\n") + 1]  # a line still being written is read next time
        self.offset += len(complete)
        new = [int(line) for line in complete.splitlines() if line.strip()]
        new = [position for position in new if position not in self.done]
        self.done.update(new)
        return new


def _check_reports(plan) -> None:
    from patches.sglang_capture import ERROR_FILE

    error = plan.folder / ERROR_FILE
    if error.exists():
        raise RuntimeError(f"the capture hooks in SGLang failed ({error}):\n{error.read_text()[-4000:]}")


def _check_outputs(outputs: Any, chunk: Sequence[int], samples) -> None:
    """Each request ended normally (an aborted request was never computed, so it would never be written)."""
    for index, output in zip(chunk, outputs if isinstance(outputs, list) else [outputs]):
        reason = ((output or {}).get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise RuntimeError(f"SGLang aborted the request for sample {samples[index].id!r}: "
                               f"{reason.get('message') or reason}")


def request_chunks(samples, todo: Sequence[int], batch_size: int) -> list[list[int]]:
    """The samples to send, longest first (similar lengths share prefill batches), in Engine.generate calls."""
    order = sorted(todo, key=lambda i: (-samples[i].num_tokens, i))
    size = max(1, batch_size * REQUESTS_PER_CALL_FACTOR)
    return [order[start:start + size] for start in range(0, len(order), size)]


def extract_with_sglang(args, info, samples, todo: Sequence[int], complete: set[int], aux_layers: Sequence[int],
                        output_dir: Path, batch_size: int, max_tokens: int, log) -> dict[str, Any]:
    """Run every sample of `todo` through SGLang with the capture hooks; returns the run's statistics
    (ExtractionStats.as_dict keys). Each sample folder is complete on disk when this returns."""
    import torch

    from common.extract.extractor import ExtractionStats
    from common.formats.hidden_states import estimate_disk_bytes, write_index
    from common.cli.stage import Progress
    from common.verifier.loading import resolve_model_path
    from patches import SGLANG_PACKAGE_ENV
    from patches.sglang_capture import ACTIVE_FILE, JOURNAL_FILE, PLAN_ENV, CapturePlan, sample_rid

    version = check_sglang_installed()
    plan = CapturePlan(output_dir=str(output_dir.resolve()), prepared_data=str(Path(args.prepared_data).resolve()),
                       vocab_size=info.vocab_size, max_seq_len=args.max_seq_len, aux_layers=list(aux_layers),
                       dtype=args.dtype, num_workers=args.num_workers, sglang_version=version)
    plan.clear_reports()
    plan.write()
    # SGLang's scheduler processes are spawned fresh: they find the hooks through these two variables and the
    # repository on their path (SGLang imports every module of the package; patches/__init__.py explains).
    os.environ[SGLANG_PACKAGE_ENV] = PATCH_PACKAGE
    os.environ[PLAN_ENV] = str(plan.path)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != str(REPO)])

    from sglang.srt.entrypoints.engine import Engine

    model_folder, _ = resolve_model_path(args.model_path)
    kwargs = engine_kwargs(args, model_folder, batch_size, max_tokens)
    log.info("starting SGLang %s with the capture hooks (tp %d, %s); loading a large verifier takes a while "
             "(Kimi-K2.5: ~20 min). Engine settings: %s", version, args.tp_size, model_folder,
             ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k != "model_path"))
    started = time.perf_counter()
    engine = Engine(**kwargs)
    engine_start_s = time.perf_counter() - started
    log.info("SGLang engine ready in %.0f s", engine_start_s)

    stats = ExtractionStats()
    journal = JournalFollower(output_dir / JOURNAL_FILE)
    todo_set = set(todo)
    element = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    last_index = time.perf_counter()

    def collect(progress) -> None:
        nonlocal last_index
        new = [i for i in journal.poll() if i in todo_set]
        if new:
            tokens = sum(samples[i].num_tokens for i in new)
            stats.samples_written += len(new)
            stats.tokens_written += tokens
            stats.bytes_written += estimate_disk_bytes(tokens, len(new), info.hidden_size, element)
            rate = stats.tokens_written / max(time.perf_counter() - started_work, 1e-9)
            progress.update(len(new), postfix=f"{rate:.0f} tok/s")
        if time.perf_counter() - last_index >= INDEX_REFRESH_S:  # run_pipeline.py --status reads index.jsonl
            last_index = time.perf_counter()
            write_index(output_dir, samples, complete | (journal.done & todo_set))

    started_work = time.perf_counter()
    try:
        with Progress(total=len(todo), desc="extract (sglang)", unit="samples") as progress:
            for number, chunk in enumerate(request_chunks(samples, todo, batch_size)):
                outputs = engine.generate(input_ids=[samples[i].input_ids.tolist() for i in chunk],
                                          sampling_params={"max_new_tokens": 0},
                                          rid=[sample_rid(samples[i].position) for i in chunk])
                _check_reports(plan)
                _check_outputs(outputs, chunk, samples)
                if number == 0 and not (output_dir / ACTIVE_FILE).exists():
                    raise RuntimeError(
                        f"SGLang ran the first {len(chunk)} requests but the capture hooks never saw a prefill "
                        f"forward: SGLang did not import {PATCH_PACKAGE}.sglang_capture (look for 'Ignore import "
                        f"error when loading {PATCH_PACKAGE}' in its log) or the verifier's text model is not one of "
                        f"{', '.join(sorted(set(SUPPORTED_ARCHITECTURES.values())))}")
                stats.batches += 1
                stats.tokens_forwarded += sum(samples[i].num_tokens for i in chunk)
                collect(progress)
            drain_started = time.perf_counter()
            last_progress = drain_started
            while not todo_set <= journal.done:  # the writers in SGLang's process finish the last batches
                _check_reports(plan)
                before = len(journal.done)
                collect(progress)
                if len(journal.done) > before:
                    last_progress = time.perf_counter()
                elif time.perf_counter() - last_progress > STALL_TIMEOUT_S:
                    missing = sorted(todo_set - journal.done)
                    raise RuntimeError(f"{len(missing)} samples were sent to SGLang but not written after "
                                       f"{STALL_TIMEOUT_S:.0f} s (first: {samples[missing[0]].id!r}); rerun to resume")
                time.sleep(0.5)
            stats.extra["drain_s"] = round(time.perf_counter() - drain_started, 3)
    finally:
        engine.shutdown()
    stats.padded_tokens = stats.tokens_forwarded  # SGLang packs requests without padding
    stats.files_written = stats.samples_written * 5
    stats.elapsed_s = time.perf_counter() - started_work
    stats.extra.update(engine_start_s=round(engine_start_s, 1), sglang_version=version)
    return stats.as_dict()
