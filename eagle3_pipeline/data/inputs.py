"""Stage 01's checks before any heavy work: flags, paths, sources, tokenizer, and the already-complete check."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.run_layout import EVAL_DATA_FILE, PREPARED_DATA_FILE
from eagle3_pipeline.data.config import DataSelection, PrepareConfig, Regeneration, Synthesis
from eagle3_pipeline.data.sources import Source, resolve_source
from eagle3_pipeline.formats.files import sha256_text
from eagle3_pipeline.formats.manifest import STATUS_COMPLETE
from eagle3_pipeline.formats.resume import earlier_manifest, refuse_other_settings, setting_differences

STAGE = "01_prepare_data"


@dataclass
class Inputs:
    """Everything checked before heavy work."""
    out: Path
    data_file: Path
    eval_file: Path
    sources: list[Source]
    tokenizer: object
    verifier_identity: dict
    template_sha: str | None
    fingerprint: dict
    device: str | None
    served_model: str | None = None  # the model name the --regenerate-endpoint serves
    excluded_prompts: set[str] = field(default_factory=set)  # --exclude-prompts, as benchmark_prompt_hashes


def check_writable(folder: Path, flag: str) -> None:
    """Create the folder and write a probe file there, or stop with a usage error naming the flag."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"{flag} {folder}: cannot write there ({err}); pick a writable folder")


def check_inputs(config: PrepareConfig) -> Inputs:
    """Paths, data sources, tokenizer, template and device: all checked in seconds, before any load (the required
    flags were checked as the config was built)."""
    from eagle3_pipeline.verifier.loading import load_tokenizer, pick_device, read_verifier_info

    data, regeneration, outputs, model = config.data, config.regeneration, config.outputs, config.verifier
    _check_synthesis(config.synthesis, regeneration)
    source_counts(data, config.synthesis)
    served_model = _check_endpoint(regeneration)
    out = Path(outputs.output_dir)
    if outputs.eval_output and data.eval_ratio == 0:
        raise UsageError("--eval-output is set but --eval-ratio is 0; give --eval-ratio (e.g. 0.01) for a "
                         "held-out split")
    eval_file = Path(outputs.eval_output) if outputs.eval_output else out / EVAL_DATA_FILE
    _check_replies(regeneration)
    check_writable(out, "--output-dir")
    if data.eval_ratio > 0:
        check_writable(eval_file.parent, "--eval-output")
    sources = [resolve_source(spec) for spec in data.datasets]
    for source in sources:
        source.check()
    excluded = excluded_prompt_hashes(data.exclude_prompts)
    device = pick_device(model.device) if regeneration.enabled and not regeneration.endpoint else None
    verifier = read_verifier_info(model.model_path, model.trust_remote_code)
    tokenizer = load_tokenizer(model.model_path, model.trust_remote_code, model.chat_template)
    template = _template_text(tokenizer)
    template_sha = sha256_text(template) if template else None
    if config.synthesis.count and template is None:
        raise UsageError(f"--synthesize: the tokenizer of --model-path {model.model_path} has no chat template, "
                         "whose opening of a user turn the verifier continues; give --chat-template FILE")
    fingerprint = _fingerprint(config, verifier.tokenizer_sha256, template_sha, eval_file, served_model)
    if excluded:  # only then, so outputs made before the flag existed stay complete
        fingerprint["excluded_prompts_sha256"] = sha256_text("".join(sorted(excluded)))
    return Inputs(out, out / PREPARED_DATA_FILE, eval_file, sources, tokenizer, verifier.identity(), template_sha,
                  fingerprint, device, served_model, excluded)


def excluded_prompt_hashes(files: Sequence[str]) -> set[str]:
    """benchmark_prompt_hashes of every turn of every prompt in the --exclude-prompts files."""
    from eagle3_pipeline.data.prompt_files import read_prompts
    from eagle3_pipeline.data.records import benchmark_prompt_hashes

    hashes: set[str] = set()
    for spec in files:
        if not Path(spec).is_file():
            raise UsageError(f"--exclude-prompts {spec}: no such file; give a prompt file such as another run's "
                             f"data/eval_data.jsonl or mt_bench.jsonl")
        for prompt in read_prompts(spec):
            for turn in prompt.turns:
                hashes |= benchmark_prompt_hashes(turn)
    return hashes


def _check_replies(regeneration: Regeneration) -> None:
    """--replies-per-prompt above 1 only makes sense for sampled regeneration; --greedy-first-reply only beside
    sampled replies."""
    replies = regeneration.replies_per_prompt
    if regeneration.greedy_first_reply and replies == 1:
        raise UsageError("--greedy-first-reply needs --replies-per-prompt 2 or more (the greedy reply and sampled "
                         "ones beside it) and --temperature > 0; without it each prompt gets one greedy reply")
    if replies == 1:
        return
    if not regeneration.enabled:
        raise UsageError(f"--replies-per-prompt {replies} is set without --regenerate; the data's "
                         "own replies exist once, so add --regenerate (with --temperature > 0)")
    if regeneration.temperature <= 0:
        raise UsageError(f"--replies-per-prompt {replies} with --temperature {regeneration.temperature}: "
                         "greedy replies to one prompt are all the same; give --temperature (e.g. 0.7)")


def _check_synthesis(synthesis: Synthesis, regeneration: Regeneration) -> None:
    """--synthesize answers its user turns as --regenerate answers the data's: it needs --regenerate."""
    if synthesis.count and not regeneration.enabled:
        raise UsageError(f"--synthesize {synthesis.count} is set without --regenerate; add --regenerate (the "
                         "verifier that writes the user turns also writes the replies, with its settings)")
    if synthesis.count and synthesis.temperature <= 0:
        raise UsageError(f"--synthesize-temperature {synthesis.temperature}: greedy user turns are all the "
                         "same; give a temperature above 0 (e.g. 1.0)")


def source_counts(data: DataSelection, synthesis: Synthesis) -> dict[str, int]:
    """--source-count SOURCE=N as {source: N}; a malformed value or a source that is not given stops here."""
    from eagle3_pipeline.data.synthesis import SOURCE

    given = set(data.datasets) | ({SOURCE} if synthesis.count else set())
    counts: dict[str, int] = {}
    for value in data.source_counts:
        source, _, number = value.rpartition("=")
        if not number.isdigit() or int(number) < 1 or source not in given:
            raise UsageError(f"--source-count {value}: expected SOURCE=N with N >= 1 and SOURCE one of "
                             f"{', '.join(sorted(given)) or '(no source given)'} (a --dataset value as given, or "
                             "synthesize with --synthesize)")
        counts[source] = int(number)
    return counts


def _check_endpoint(regeneration: Regeneration) -> str | None:
    """--regenerate-endpoint answers (before any data is read); returns the model name it serves."""
    if not regeneration.endpoint:
        return None
    if not regeneration.enabled:
        raise UsageError("--regenerate-endpoint is set without --regenerate; add --regenerate to regenerate the "
                         "responses through it")
    from eagle3_pipeline.data.responders import check_endpoint

    return check_endpoint(regeneration.endpoint)


# --- the fingerprint: what the output depends on ------------------------------------------------------

def _template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return json.dumps(template, sort_keys=True)
    return template or None


def _dataset_identity(spec: str) -> str:
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _fingerprint(config: PrepareConfig, tokenizer_sha: str, template_sha: str | None, eval_file: Path,
                 served_model: str | None = None) -> dict:
    """The settings the output depends on; a complete output made with other settings is not reused."""
    data, regeneration = config.data, config.regeneration
    fingerprint = {
        "model_path": config.verifier.model_path, "tokenizer_sha256": tokenizer_sha,
        "chat_template_sha256": template_sha, "datasets": [_dataset_identity(spec) for spec in data.datasets],
        "max_seq_len": data.max_seq_len, "num_samples": data.num_samples, "seed": config.seed,
        "eval_ratio": data.eval_ratio, "eval_output": str(eval_file.resolve()) if data.eval_ratio > 0 else None,
        # a --regenerate not given was always recorded as the parser's None
        "regenerate": regeneration.enabled or None, "max_turns": data.max_turns,
    }
    if regeneration.enabled:
        fingerprint.update(max_new_tokens=regeneration.max_new_tokens, temperature=regeneration.temperature,
                           **generator_identity(config, served_model))
        if regeneration.replies_per_prompt > 1:  # only then, so outputs made before the flag existed stay complete
            fingerprint["replies_per_prompt"] = regeneration.replies_per_prompt
        if regeneration.greedy_first_reply:  # likewise
            fingerprint["greedy_first_reply"] = True
    if config.synthesis.count:  # likewise
        fingerprint.update(config.synthesis.as_flags())
    if data.source_counts:  # likewise
        fingerprint["source_count"] = sorted(data.source_counts)
    return fingerprint


def generator_identity(config: PrepareConfig, served_model: str | None) -> dict:
    """What generates the responses: the in-process dtype, or the endpoint and the model it serves."""
    if config.regeneration.endpoint:
        from eagle3_pipeline.data.responders import endpoint_base

        return {"dtype": None, "regenerate_endpoint": endpoint_base(config.regeneration.endpoint),
                "served_model": served_model}
    return {"dtype": config.verifier.dtype}


# --- an output already there --------------------------------------------------------------------------

def already_complete(out: Path, data_file: Path, fingerprint: dict, overwrite: bool, log) -> bool:
    """True when OUTPUT_DIR already holds this exact output; refuses one made with other settings."""
    existing = earlier_manifest(out, STAGE, overwrite)
    if existing is None or overwrite or existing.get("status") != STATUS_COMPLETE or not data_file.exists():
        return False  # redone: --overwrite, or an unfinished run (regenerated responses are reused)
    refuse_other_settings(f"{out} already holds a complete {STAGE} output",
                          setting_differences(existing.get("fingerprint", {}), fingerprint),
                          "Rerun with --overwrite to replace it, or choose another --output-dir / --run-dir")
    counts = existing.get("counts", {})
    log.info("%s is already complete in %s (%s samples, %s tokens); nothing to do (--overwrite redoes it)",
             STAGE, out, counts.get("samples"), counts.get("tokens"))
    return True

