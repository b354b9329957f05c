"""Stage 02's settings, typed. ExtractionConfig.from_args builds them once from the parsed flags; it is the one place
the extraction library reads the Namespace. Every default is the flag table's (eagle3_pipeline/cli/flags.py); the values
are kept as parsed (switches left unset read as False), so the manifest, the resume command and the log say what they
said before."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_pipeline.formats.manifest import resolved_config
from eagle3_pipeline.formats.storage import StorageFormat, format_of_flags
from eagle3_pipeline.verifier.sglang_settings import chosen_settings


@dataclass(frozen=True)
class VerifierSettings:
    """Which verifier runs and how it is loaded: --model-path, --trust-remote-code, --device, --device-map, --dtype."""
    model_path: str
    trust_remote_code: bool
    device: str  # as given (auto, cpu, cuda, cuda:N); eagle3_pipeline.verifier.loading.pick_device resolves it
    device_map: str
    dtype: str  # the verifier's computation on a GPU, and the dtype the states are stored in

    @classmethod
    def from_args(cls, args) -> "VerifierSettings":
        return cls(args.model_path, bool(args.trust_remote_code), args.device, args.device_map, args.dtype)


@dataclass(frozen=True)
class BatchSettings:
    """How the samples are cut and grouped into forwards, and who writes them: --max-seq-len, --batch-size and
    --max-tokens-per-batch (None: the device's default, eagle3_pipeline.extract.run), --num-workers."""
    max_seq_len: int
    batch_size: int | None
    max_tokens_per_batch: int | None
    num_workers: int

    @classmethod
    def from_args(cls, args) -> "BatchSettings":
        return cls(args.max_seq_len, args.batch_size, args.max_tokens_per_batch, args.num_workers)


@dataclass(frozen=True)
class OutputSettings:
    """What is read and where the states go, and what becomes of an earlier output there: --prepared-data,
    --output-dir, --overwrite, --rebuild-manifest, --allow-low-disk, --skip-nonfinite."""
    prepared_data: str
    output_dir: str
    overwrite: bool
    rebuild_manifest: bool
    allow_low_disk: bool
    skip_nonfinite: bool

    @classmethod
    def from_args(cls, args) -> "OutputSettings":
        return cls(args.prepared_data, args.output_dir, bool(args.overwrite), bool(args.rebuild_manifest),
                   bool(args.allow_low_disk), bool(args.skip_nonfinite))


@dataclass(frozen=True)
class StorageSettings:
    """How the states are stored: --aux-dtype, --targets, --target-topk (and --dtype, the verifier's)."""
    aux_dtype: str
    targets: str
    target_topk: int

    @classmethod
    def from_args(cls, args) -> "StorageSettings":
        return cls(args.aux_dtype, args.targets, args.target_topk)

    def format(self, dtype: str, vocab_size: int) -> StorageFormat:
        return format_of_flags(dtype, self.aux_dtype, self.targets, self.target_topk, vocab_size)


@dataclass(frozen=True)
class SGLangSettings:
    """The SGLang engine of --backend sglang: --tp-size, --gpu-memory-utilization, the user's engine settings
    (--attention-backend, --sampling-backend, --sglang-arg) and --allow-untested-sglang."""
    tp_size: int
    gpu_memory_utilization: float
    attention_backend: str | None
    sampling_backend: str | None
    sglang_args: tuple[str, ...]  # the --sglang-arg KEY=VALUE pairs, as given
    allow_untested: bool

    @classmethod
    def from_args(cls, args) -> "SGLangSettings":
        return cls(args.tp_size, args.gpu_memory_utilization, args.attention_backend, args.sampling_backend,
                   tuple(args.sglang_arg or ()), bool(args.allow_untested_sglang))

    def engine_settings(self) -> dict[str, Any]:
        """The server arguments these flags choose (unset ones are left to SGLang)."""
        return chosen_settings(self.sglang_args, self.attention_backend, self.sampling_backend)


@dataclass(frozen=True)
class ExtractionConfig:
    """Everything stage 02 extracts with: the engine (--backend), the run folder, the aux layers as given, the parts
    above, and the flags as the manifest records them (a rerun compares them to decide whether to resume)."""
    backend: str
    run_dir: str | None
    aux_layers: tuple[int, ...] | None  # --aux-layers; None: the verifier's default layers
    verifier: VerifierSettings
    batches: BatchSettings
    output: OutputSettings
    storage: StorageSettings
    sglang: SGLangSettings
    recorded_flags: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_args(cls, args) -> "ExtractionConfig":
        return cls(backend=args.backend, run_dir=args.run_dir,
                   aux_layers=tuple(args.aux_layers) if args.aux_layers else None,
                   verifier=VerifierSettings.from_args(args), batches=BatchSettings.from_args(args),
                   output=OutputSettings.from_args(args), storage=StorageSettings.from_args(args),
                   sglang=SGLangSettings.from_args(args), recorded_flags=resolved_config(args))

    def storage_format(self, vocab_size: int) -> StorageFormat:
        """The format these flags store a verifier of `vocab_size` tokens in."""
        return self.storage.format(self.verifier.dtype, vocab_size)
