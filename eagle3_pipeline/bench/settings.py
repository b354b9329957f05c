"""Stage 05's settings: the typed inputs its library takes, built once from the parsed flags (BenchConfig.from_args,
the one place in eagle3_pipeline/bench that reads them), and what a benchmark report records of its run: the stage name
and the flags each mode's settings table shows."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

STAGE = "05_benchmark"

_SETTINGS = {  # the flags each mode's report records (and its Markdown settings table shows)
    "offline": ("model_path", "draft_model_path", "prompts", "num_prompts", "max_new_tokens", "num_steps", "topk",
                "num_draft_tokens", "temperature", "top_p", "acceptance_rule", "device", "dtype", "seed", "chat_template",
                "allow_overlap", "tau_only"),
    "server": ("url", "baseline_url", "server_api", "model_path", "prompts", "num_prompts", "max_new_tokens",
               "temperature", "top_p", "concurrency", "chat_template", "allow_overlap", "draft_model_path"),
    "eval": ("model_path", "draft_model_path", "data_dir", "num_steps", "num_prompts", "max_new_tokens", "device",
             "dtype", "seed"),
}

# Every field below is named after its flag's dest, so a report records a flag by that name (flag_values).


@dataclass(frozen=True)
class VerifierSpec:
    """Which verifier and how it is loaded (offline and eval mode load it here; server mode only its tokenizer)."""
    model_path: str | None
    trust_remote_code: bool | None  # as given: None (not given) lets transformers ask before running a model's code
    chat_template: str | None
    device: str
    dtype: str
    allow_other_verifier: bool


@dataclass(frozen=True)
class BenchInputs:
    """What is measured: the drafter, on the prompts (offline, server) or on stage 02's hidden states (eval)."""
    draft_model_path: str | None
    prompts: str | None  # as given; None: the run's held-out split
    num_prompts: int | None  # None: all
    run_dir: str | None
    data_dir: str | None
    allow_overlap: bool


@dataclass(frozen=True)
class DecodingSettings:
    """What is generated and how: the draft shape, the sampling, the token budget, the baselines, the processes."""
    max_new_tokens: int
    num_steps: int
    topk: int
    num_draft_tokens: int | None  # None: the draft shape's own (speculative.resolve_draft_shape)
    temperature: float
    top_p: float
    acceptance_rule: str
    seed: int
    tau_only: bool
    decode_workers: int


@dataclass(frozen=True)
class ServerTarget:
    """Where --mode server sends the prompts, and how."""
    url: str | None
    baseline_url: str | None
    server_api: str
    concurrency: int


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: its mode, where its reports go, and its parts."""
    mode: str
    output_dir: str
    verifier: VerifierSpec
    inputs: BenchInputs
    decoding: DecodingSettings
    server: ServerTarget

    @classmethod
    def from_args(cls, args) -> BenchConfig:
        """The parsed flags (defaults from eagle3_pipeline/cli/flags.py); a switch not given (None) becomes False."""
        verifier = VerifierSpec(model_path=args.model_path, trust_remote_code=args.trust_remote_code,
                                chat_template=args.chat_template, device=args.device, dtype=args.dtype,
                                allow_other_verifier=bool(args.allow_other_verifier))
        inputs = BenchInputs(draft_model_path=args.draft_model_path, prompts=args.prompts,
                             num_prompts=args.num_prompts, run_dir=args.run_dir, data_dir=args.data_dir,
                             allow_overlap=bool(args.allow_overlap))
        decoding = DecodingSettings(max_new_tokens=args.max_new_tokens, num_steps=args.num_steps, topk=args.topk,
                                    num_draft_tokens=args.num_draft_tokens, temperature=args.temperature,
                                    top_p=args.top_p, acceptance_rule=args.acceptance_rule, seed=args.seed,
                                    tau_only=bool(args.tau_only), decode_workers=args.decode_workers)
        server = ServerTarget(url=args.url, baseline_url=args.baseline_url, server_api=args.server_api,
                              concurrency=args.concurrency)
        return cls(mode=args.mode, output_dir=args.output_dir, verifier=verifier, inputs=inputs, decoding=decoding,
                   server=server)

    def flag_values(self) -> dict[str, Any]:
        """Every flag's value by its dest."""
        values = {"mode": self.mode, "output_dir": self.output_dir}
        for part in (self.verifier, self.inputs, self.decoding, self.server):
            values.update({field.name: getattr(part, field.name) for field in fields(part)})
        return values


def recorded_settings(config: BenchConfig, extra: dict) -> dict:
    """The recorded flags of the run's mode, the drafter checkpoint's folder name, then `extra`."""
    values = config.flag_values()
    settings = {"mode": config.mode}
    settings.update({key: values[key] for key in _SETTINGS[config.mode]})
    draft_model_path = config.inputs.draft_model_path
    if draft_model_path and Path(draft_model_path).exists():
        settings["draft_checkpoint"] = Path(draft_model_path).resolve().name
    settings.update(extra)
    return settings


def chosen_settings(settings: dict) -> list[tuple[str, Any]]:
    """A report's settings as a person sets them, (--flag, value) in the recorded order; what the run worked out
    beside them (the device's name, stop tokens, the baselines reused, ...) stays in the JSON."""
    return [("--" + key.replace("_", "-"), settings.get(key)) for key in _SETTINGS.get(settings.get("mode"), ())]
