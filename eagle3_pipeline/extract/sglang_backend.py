"""Stage 02 with SGLang as the engine (`--backend sglang --tp-size 8`), in the stage's process: preflight, the
capture plan, the engine and its requests, progress. Division of labour and engine settings: docs/extraction.md."""
from __future__ import annotations

import importlib.util
import math
import os
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.extract.config import ExtractionConfig, SGLangSettings
from eagle3_pipeline.verifier.sglang_settings import check_setting_names, installed_sglang_root, server_arg_names
from patches.sglang_releases import NEWEST, SGLangRelease, release_for, version_problem

REPO = Path(__file__).resolve().parents[2]
PATCH_PACKAGE = "patches"

# Verifier architectures -> the text model patches/sglang_capture.py hooks for them, in every checked SGLang release.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaModel",
    "DeepseekV2ForCausalLM": "DeepseekV2Model",
    "DeepseekV3ForCausalLM": "DeepseekV2Model",
    "KimiK25ForConditionalGeneration": "DeepseekV2Model",  # its language_model.model
}
REQUESTS_PER_CALL_FACTOR = 8  # requests per Engine.generate call: this many batches' worth
CHUNKS_IN_FLIGHT = 2  # generate calls queued to the engine's process: one running, one waiting
STAGE_SCRIPT = "02_extract_hidden_states.py"
STALL_TIMEOUT_S = 900.0  # no sample finished for this long after the last request returned: give up
INDEX_REFRESH_S = 60.0


# --- preflight (seconds, before the engine loads) ---------------------------------------------------------------

def installed_release(allow_untested: bool = False) -> tuple[str, SGLangRelease]:
    """The installed SGLang's version (read from its metadata; nothing is imported) and the checked release whose
    table applies to it. An untested version is refused (UsageError naming the checked releases and the fix) unless
    `allow_untested`, when the newest checked release's table applies."""
    from patches import installed_sglang_version

    installed = installed_sglang_version() if importlib.util.find_spec("sglang") is not None else None
    problem = version_problem(installed)
    if problem is not None and (installed is None or not allow_untested):
        raise UsageError(f"--backend sglang: {problem}")
    return installed, release_for(installed)


def check_sglang_installed(allow_untested: bool = False) -> str:
    """installed_release, saying so in the log when an untested release is tried. Returns the installed version."""
    from eagle3_pipeline.log import get_logger

    version, release = installed_release(allow_untested)
    if version != release.version:
        get_logger().warning("--allow-untested-sglang: SGLang %s is not a release the capture hooks are checked "
                             "against; trying it with %s's settings and hooks. Check its output with "
                             "scripts/check_sglang_capture.py before training on it", version, release.version)
    return version


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_sglang_early(config: ExtractionConfig) -> str:
    """The --backend sglang checks that need nothing but the flags (before the verifier config is read):
    a checked SGLang release, one process, GPUs for --tp-size. Raises UsageError; returns the SGLang version."""
    device, tp_size = config.verifier.device, config.sglang.tp_size
    version = check_sglang_installed(config.sglang.allow_untested)
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise UsageError("--backend sglang starts its own processes (one per --tp-size GPU): run stage 02 as one "
                         "process, without torchrun")
    if device == "cpu" or device.startswith("cuda:"):
        raise UsageError(f"--device {device}: --backend sglang runs on the GPUs SGLang is given "
                         f"(CUDA_VISIBLE_DEVICES and --tp-size); leave --device at auto")
    visible = visible_gpu_count()
    if visible < tp_size:
        raise UsageError(f"--backend sglang --tp-size {tp_size} needs {tp_size} GPUs, {visible} visible here "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if config.output.skip_nonfinite:
        raise UsageError("--skip-nonfinite is for --backend hf: with --backend sglang a sample whose hidden states "
                         "hold NaN or inf stops stage 02, named with the layer (samples already written are kept)")
    if os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE") not in (None, "", PATCH_PACKAGE):
        raise UsageError(f"SGLANG_EXTERNAL_MODEL_PACKAGE={os.environ['SGLANG_EXTERNAL_MODEL_PACKAGE']} is set; stage "
                         f"02 needs it for its own hooks ({PATCH_PACKAGE}): unset it")
    return version


def check_sglang_verifier(model_path: str, info, aux_layers: Sequence[int] = ()) -> None:
    """The verifier is one whose text model the hooks cover, in a folder SGLang can load, and the installed
    release's text model can capture the aux layers."""
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        raise UsageError(f"--backend sglang: the capture hooks cover {', '.join(sorted(SUPPORTED_ARCHITECTURES))}; "
                         f"--model-path {model_path} is {info.architecture}. Use --backend hf for it")
    if str(model_path).endswith(".gguf"):
        raise UsageError("--backend sglang needs a Hugging Face folder as --model-path, not a GGUF file")
    if 0 in aux_layers:
        version, release = installed_release(allow_untested=True)  # the version itself was checked before
        text_model = release.text_model(SUPPORTED_ARCHITECTURES[info.architecture])
        if not text_model.captures_layer_zero:
            raise UsageError(f"--aux-layers {','.join(map(str, aux_layers))}: SGLang {version}'s {text_model.name} "
                             f"cannot capture layer 0, the embedding output (its layer loop adds a residual that does "
                             f"not exist yet there). Choose layers above 0, or pip install sglang=={NEWEST.version}, "
                             f"or use --backend hf")


def engine_kwargs(release: SGLangRelease, config: ExtractionConfig, model_folder: str, batch_size: int,
                  max_tokens: int, mem_fraction_static: float | None = None) -> dict[str, Any]:
    """sglang.Engine(**kwargs) for extraction: the installed release's capture settings (their names differ between
    releases: patches/sglang_releases.py) plus the stage's own flags (the memory fraction lowered by the capture's
    own buffers: CaptureMemory)."""
    sglang, verifier = config.sglang, config.verifier
    kwargs = dict(release.capture_settings)
    fraction = sglang.gpu_memory_utilization if mem_fraction_static is None else mem_fraction_static
    kwargs.update(model_path=model_folder, tp_size=sglang.tp_size, dtype=verifier.dtype,
                  trust_remote_code=verifier.trust_remote_code, mem_fraction_static=fraction,
                  max_running_requests=batch_size, max_prefill_tokens=max_tokens, log_level="info")
    kwargs.update(sglang.engine_settings())  # the user's backends and --sglang-arg, checked by check_engine_settings
    return kwargs


def check_engine_settings(sglang: SGLangSettings, release: str) -> dict[str, Any]:
    """The user's engine settings name server arguments of the installed release and leave the capture's own alone
    (before the verifier loads). Returns them."""
    settings = sglang.engine_settings()
    sglang_root = installed_sglang_root()
    if settings and sglang_root is not None:
        reserved = {name: "stage 02's capture sets it itself (docs/extraction.md); leave it out"
                    for name in release_for(release).capture_settings}
        check_setting_names(settings, server_arg_names(sglang_root), release, reserved)
    return settings


# --- GPU memory the capture takes outside SGLang's plan -----------------------------------------------------------

@dataclass
class CaptureMemory:
    """The capture's GPU buffers, which SGLang's memory plan does not know about, and the lowered fraction.

    SGLang sizes its KV cache from the GPU memory left after the weights minus a slack of
    pre_model_load_memory * (1 - mem_fraction_static) for activations (0.5.17 and 0.5.23 alike:
    sglang/srt/mem_cache/kv_cache_configurator.py KVCacheConfigurator._profile_available_bytes). The capture adds,
    in the longest forward, the aux [T, layers x H] on every rank (packed, or a list of layers: the same bytes) and,
    on rank 0, the requests' rows of aux and final gathered in the stored dtype; lowering the fraction by their
    share of the GPU widens the slack by as much, so the first and longest batch cannot run out of memory."""
    tokens: int
    aux_bytes: int
    gather_bytes: int
    gpu_bytes: int
    requested: float
    mem_fraction_static: float

    @property
    def extra_bytes(self) -> int:
        return self.aux_bytes + self.gather_bytes

    def describe(self) -> str:
        from eagle3_pipeline.formats.hidden_states import human_bytes

        return (f"capture buffers outside SGLang's memory plan, at {self.tokens} tokens per forward: the packed aux "
                f"{human_bytes(self.aux_bytes)} on every GPU, plus rank 0's gather {human_bytes(self.gather_bytes)}; "
                f"--gpu-memory-utilization {self.requested} is lowered by "
                f"{self.requested - self.mem_fraction_static:.3f} of the GPU's {human_bytes(self.gpu_bytes)} to "
                f"mem_fraction_static={self.mem_fraction_static}")


def capture_memory(tokens: int, hidden_size: int, num_aux: int, element_size: int, gpu_bytes: int,
                   requested: float, weights_per_gpu: int | None = None) -> CaptureMemory:
    """The capture's buffers for a forward of `tokens` tokens, and the fraction SGLang may plan with; refuses
    (UsageError with the numbers) when the weights would no longer fit."""
    from eagle3_pipeline.formats.hidden_states import human_bytes

    aux = tokens * num_aux * hidden_size * element_size
    gather = tokens * (num_aux + 1) * hidden_size * element_size
    lowered = math.floor((requested - (aux + gather) / gpu_bytes) * 1000) / 1000
    memory = CaptureMemory(tokens, aux, gather, gpu_bytes, requested, lowered)
    if lowered <= 0 or (weights_per_gpu is not None and lowered * gpu_bytes <= weights_per_gpu):
        weights = f" the weights take about {human_bytes(weights_per_gpu)} per GPU," if weights_per_gpu else ""
        raise UsageError(f"{memory.describe()}, which leaves SGLang no room:{weights} {lowered} of "
                         f"{human_bytes(gpu_bytes)} = {human_bytes(max(lowered, 0) * gpu_bytes)}. Lower "
                         f"--max-tokens-per-batch (the buffers scale with it), or raise --gpu-memory-utilization")
    return memory


def gpu_memory_bytes() -> int:
    """Total memory of the first visible GPU, read through NVML when it is there (no CUDA context in stage 02's
    process, whose GPU 0 is SGLang's rank 0)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            handle = (pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                      else pynvml.nvmlDeviceGetHandleByIndex(0))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML (or a UUID in CUDA_VISIBLE_DEVICES): ask CUDA
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)


def plan_capture_memory(config: ExtractionConfig, info, samples, aux_layers: Sequence[int], max_tokens: int,
                        log) -> CaptureMemory:
    """Stage 02's preflight of the capture's GPU memory: computed, stated, and taken off the memory fraction."""
    import torch

    from eagle3_pipeline.verifier.loading import weights_bytes

    longest = max((s.num_tokens for s in samples), default=0)
    weights = weights_bytes(config.verifier.model_path)
    memory = capture_memory(max(max_tokens, longest), info.hidden_size, len(aux_layers),
                            torch.empty(0, dtype=getattr(torch, config.verifier.dtype)).element_size(),
                            gpu_memory_bytes(), config.sglang.gpu_memory_utilization,
                            weights // config.sglang.tp_size if weights else None)
    log.info("GPU memory: %s", memory.describe())
    return memory


# --- how a failed run is reported -------------------------------------------------------------------------------

class HooksFailed(RuntimeError):
    """The capture hooks in SGLang's process wrote their error file."""


class SGLangRunFailed(RuntimeError):
    """Stage 02's SGLang run stopped: the message says why, what is on disk and how to resume; `details` go
    into the manifest."""

    def __init__(self, message: str, details: dict[str, Any]):
        super().__init__(message)
        self.details = details


def resume_command(config: ExtractionConfig) -> str:
    """The command that resumes this run (same settings; complete samples are kept)."""
    verifier, batches, sglang = config.verifier, config.batches, config.sglang
    argv = ["python", STAGE_SCRIPT]
    if config.run_dir:
        argv += ["--run-dir", str(config.run_dir)]
    argv += ["--model-path", str(verifier.model_path), "--prepared-data", str(config.output.prepared_data),
             "--output-dir", str(config.output.output_dir), "--backend", "sglang", "--tp-size", str(sglang.tp_size),
             "--gpu-memory-utilization", str(sglang.gpu_memory_utilization), "--dtype", verifier.dtype,
             "--max-seq-len", str(batches.max_seq_len), "--num-workers", str(batches.num_workers)]
    for flag, value in (("--batch-size", batches.batch_size), ("--max-tokens-per-batch", batches.max_tokens_per_batch)):
        if value:
            argv += [flag, str(value)]
    if config.aux_layers:
        argv += ["--aux-layers", ",".join(str(layer) for layer in config.aux_layers)]
    if verifier.trust_remote_code:
        argv.append("--trust-remote-code")
    if sglang.allow_untested:
        argv.append("--allow-untested-sglang")
    return shlex.join(argv)


def run_failure(err: BaseException, config: ExtractionConfig, plan, samples, output_dir: Path) -> SGLangRunFailed:
    """What stage 02 says when the SGLang run stops: the cause, the hooks' error file, what is kept, the resume
    command."""
    from eagle3_pipeline.extract.output import scan_output
    from patches.sglang_capture import ERROR_FILE

    error_file = plan.folder / ERROR_FILE
    complete = len(scan_output(output_dir, samples, clean=False))
    command = resume_command(config)
    if error_file.exists():
        hooks = f"the capture hooks' error file {error_file}:\n{error_file.read_text()[-4000:]}"
    else:
        hooks = f"the capture hooks recorded no error ({error_file} is absent)"
    message = (f"the SGLang run stopped: {err}\n{hooks}\n{complete} of {len(samples)} samples are complete on disk "
               f"and are kept; resume with:\n    {command}")
    details = {"error": str(err)[-2000:], "hooks_error_file": str(error_file) if error_file.exists() else None,
               "complete_samples": complete, "samples": len(samples), "resume_command": command}
    return SGLangRunFailed(message, details)


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

    if (plan.folder / ERROR_FILE).exists():
        raise HooksFailed("the capture hooks in SGLang's process failed")


def request_chunks(samples, todo: Sequence[int], batch_size: int) -> list[list[int]]:
    """The samples to send, longest first (similar lengths share prefill batches), in Engine.generate calls."""
    order = sorted(todo, key=lambda i: (-samples[i].num_tokens, i))
    size = max(1, batch_size * REQUESTS_PER_CALL_FACTOR)
    return [order[start:start + size] for start in range(0, len(order), size)]


def extract_with_sglang(config: ExtractionConfig, info, samples, todo: Sequence[int], complete: set[int],
                        aux_layers: Sequence[int], output_dir: Path, batch_size: int, max_tokens: int, log,
                        memory: CaptureMemory | None = None) -> dict[str, Any]:
    """Run every sample of `todo` through SGLang with the capture hooks; returns the run's statistics
    (ExtractionStats.as_dict keys). Each sample folder is complete on disk when this returns; when the run stops
    early it raises SGLangRunFailed (cause, the hooks' error file, samples kept, resume command). `memory`: the
    preflight's plan_capture_memory (made here when not given)."""
    from eagle3_pipeline.verifier import sglang_engine
    from eagle3_pipeline.verifier.loading import resolve_model_path
    from patches import SGLANG_PACKAGE_ENV
    from patches.sglang_capture import PLAN_ENV, CapturePlan

    verifier, batches = config.verifier, config.batches
    version, release = installed_release(config.sglang.allow_untested)
    memory = memory or plan_capture_memory(config, info, samples, aux_layers, max_tokens, log)
    plan = CapturePlan(output_dir=str(output_dir.resolve()),
                       prepared_data=str(Path(config.output.prepared_data).resolve()),
                       vocab_size=info.vocab_size, max_seq_len=batches.max_seq_len, aux_layers=list(aux_layers),
                       dtype=verifier.dtype, num_workers=batches.num_workers, sglang_version=version,
                       sglang_release=release.version)
    plan.clear_reports()
    plan.write()
    # SGLang's scheduler processes are spawned fresh: they find the hooks through these two variables and the
    # repository on their path (SGLang imports every module of the package; patches/__init__.py explains).
    os.environ[SGLANG_PACKAGE_ENV] = PATCH_PACKAGE
    os.environ[PLAN_ENV] = str(plan.path)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != str(REPO)])

    model_folder, _ = resolve_model_path(verifier.model_path)
    kwargs = engine_kwargs(release, config, model_folder, batch_size, max_tokens, memory.mem_fraction_static)
    log.info("starting SGLang %s with the capture hooks in a supervised engine process (tp %d, %s); loading a "
             "large verifier takes a while (Kimi-K2.5: ~20 min). Engine settings: %s", version, config.sglang.tp_size,
             model_folder, ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k != "model_path"))
    engine = sglang_engine.EngineProcess(kwargs, sglang_engine.SGLANG_ENGINE)
    try:
        engine.start()
        stats = _run_requests(engine, plan, samples, todo, complete, output_dir, batch_size, info, verifier.dtype, log)
    except Exception as err:  # noqa: BLE001 - every way the run stops is reported the same way
        engine.stop(graceful=False)  # no writer of the engine's process is busy while the samples are counted
        raise run_failure(err, config, plan, samples, output_dir) from err
    finally:
        engine.stop()
    stats.extra.update(sglang_version=version, sglang_release=release.version, capture_memory=asdict(memory))
    return stats.as_dict()


def _run_requests(engine, plan, samples, todo: Sequence[int], complete: set[int], output_dir: Path,
                  batch_size: int, info, dtype: str, log):
    """Feed the engine's process the request chunks and follow the journal until every sample is on disk."""
    import torch

    from eagle3_pipeline.progress import Progress
    from eagle3_pipeline.extract.extractor import ExtractionStats
    from eagle3_pipeline.formats.hidden_states import estimate_disk_bytes, write_index
    from patches.sglang_capture import ACTIVE_FILE, JOURNAL_FILE, sample_rid

    engine_start_s = engine.wait_ready(lambda: _check_reports(plan))
    log.info("SGLang engine ready in %.0f s", engine_start_s)
    stats = ExtractionStats()
    journal = JournalFollower(output_dir / JOURNAL_FILE)
    todo_set = set(todo)
    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    chunks = request_chunks(samples, todo, batch_size)
    started_work = last_index = time.perf_counter()

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

    with Progress(total=len(todo), desc="extract (sglang)", unit="samples") as progress:
        submitted, answered = 0, 0
        while answered < len(chunks):
            while submitted < len(chunks) and submitted - answered < CHUNKS_IN_FLIGHT:
                chunk = chunks[submitted]
                engine.submit(submitted, [sample_rid(samples[i].position) for i in chunk],
                              [samples[i].input_ids.tolist() for i in chunk])
                submitted += 1
            for message in engine.messages():
                if message[0] != "done":
                    continue
                _, number, aborted = message
                chunk = chunks[number]
                if aborted:
                    index, reason = aborted[0]
                    raise RuntimeError(f"SGLang aborted {len(aborted)} requests, the first for sample "
                                       f"{samples[chunk[index]].id!r}: {reason}")
                _check_reports(plan)
                if number == 0 and not (output_dir / ACTIVE_FILE).exists():
                    raise RuntimeError(
                        f"SGLang ran the first {len(chunk)} requests but the capture hooks never saw a prefill "
                        f"forward: SGLang did not import {PATCH_PACKAGE}.sglang_capture (look for 'Ignore import "
                        f"error when loading {PATCH_PACKAGE}' in its log) or the verifier's text model is not one of "
                        f"{', '.join(sorted(set(SUPPORTED_ARCHITECTURES.values())))}")
                answered += 1
                stats.batches += 1
                stats.tokens_forwarded += sum(samples[i].num_tokens for i in chunk)
            _check_reports(plan)
            collect(progress)
        drain_started = last_progress = time.perf_counter()
        while not todo_set <= journal.done:  # the writers in SGLang's process finish the last batches
            _check_reports(plan)
            before = len(journal.done)
            collect(progress)
            engine.messages(timeout=0.5)  # raises when the engine's process has died
            if len(journal.done) > before:
                last_progress = time.perf_counter()
            elif time.perf_counter() - last_progress > STALL_TIMEOUT_S:
                missing = sorted(todo_set - journal.done)
                raise RuntimeError(f"{len(missing)} samples were sent to SGLang but not written after "
                                   f"{STALL_TIMEOUT_S:.0f} s (first: {samples[missing[0]].id!r})")
        stats.extra["drain_s"] = round(time.perf_counter() - drain_started, 3)
    stats.padded_tokens = stats.tokens_forwarded  # SGLang packs requests without padding
    stats.files_written = stats.samples_written * 5
    stats.elapsed_s = time.perf_counter() - started_work
    stats.extra["engine_start_s"] = round(engine_start_s, 1)
    return stats
