"""Stage 01's checks before any heavy work: flags, paths, sources, tokenizer, and the already-complete check."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UsageError, require
from common.formats.run_layout import EVAL_DATA_FILE, PREPARED_DATA_FILE
from common.data.sources import Source, resolve_source
from common.formats.files import sha256_text
from common.formats.manifest import STATUS_COMPLETE
from common.formats.resume import earlier_manifest, refuse_other_settings, setting_differences

STAGE = "01_prepare_data"
SYNTHESIS_FLAGS = ("synthesize", "synthesize_turns", "synthesize_temperature", "synthesize_top_p",
                   "synthesize_max_tokens", "near_duplicate_threshold")


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


def check_inputs(args) -> Inputs:
    """Paths, data sources, tokenizer, template and device: all checked in seconds, before any load."""
    from common.verifier.loading import load_tokenizer, pick_device, read_verifier_info

    require(args, "model_path", *(() if args.synthesize else ("dataset",)))
    _check_synthesis(args)
    source_counts(args)
    served_model = _check_endpoint(args)
    out = Path(args.output_dir)
    if args.eval_output and args.eval_ratio == 0:
        raise UsageError("--eval-output is set but --eval-ratio is 0; give --eval-ratio (e.g. 0.01) for a "
                         "held-out split")
    eval_file = Path(args.eval_output) if args.eval_output else out / EVAL_DATA_FILE
    _check_replies(args)
    check_writable(out, "--output-dir")
    if args.eval_ratio > 0:
        check_writable(eval_file.parent, "--eval-output")
    sources = [resolve_source(spec) for spec in args.dataset or []]
    for source in sources:
        source.check()
    excluded = excluded_prompt_hashes(args.exclude_prompts or [])
    device = pick_device(args.device) if args.regenerate and not args.regenerate_endpoint else None
    verifier = read_verifier_info(args.model_path, args.trust_remote_code)
    tokenizer = load_tokenizer(args.model_path, args.trust_remote_code, args.chat_template)
    template = _template_text(tokenizer)
    template_sha = sha256_text(template) if template else None
    if args.synthesize and template is None:
        raise UsageError(f"--synthesize: the tokenizer of --model-path {args.model_path} has no chat template, whose "
                         "opening of a user turn the verifier continues; give --chat-template FILE")
    fingerprint = _fingerprint(args, verifier.tokenizer_sha256, template_sha, eval_file, served_model)
    if excluded:  # only then, so outputs made before the flag existed stay complete
        fingerprint["excluded_prompts_sha256"] = sha256_text("".join(sorted(excluded)))
    return Inputs(out, out / PREPARED_DATA_FILE, eval_file, sources, tokenizer, verifier.identity(), template_sha,
                  fingerprint, device, served_model, excluded)


def excluded_prompt_hashes(files: list[str]) -> set[str]:
    """benchmark_prompt_hashes of every turn of every prompt in the --exclude-prompts files."""
    from common.data.prompt_files import read_prompts
    from common.data.records import benchmark_prompt_hashes

    hashes: set[str] = set()
    for spec in files:
        if not Path(spec).is_file():
            raise UsageError(f"--exclude-prompts {spec}: no such file; give a prompt file such as another run's "
                             f"data/eval_data.jsonl or mt_bench.jsonl")
        for prompt in read_prompts(spec):
            for turn in prompt.turns:
                hashes |= benchmark_prompt_hashes(turn)
    return hashes


def _check_replies(args) -> None:
    """--replies-per-prompt above 1 only makes sense for sampled regeneration; --greedy-first-reply only beside
    sampled replies."""
    if args.greedy_first_reply and args.replies_per_prompt == 1:
        raise UsageError("--greedy-first-reply needs --replies-per-prompt 2 or more (the greedy reply and sampled "
                         "ones beside it) and --temperature > 0; without it each prompt gets one greedy reply")
    if args.replies_per_prompt == 1:
        return
    if not args.regenerate:
        raise UsageError(f"--replies-per-prompt {args.replies_per_prompt} is set without --regenerate; the data's "
                         "own replies exist once, so add --regenerate (with --temperature > 0)")
    if args.temperature <= 0:
        raise UsageError(f"--replies-per-prompt {args.replies_per_prompt} with --temperature {args.temperature}: "
                         "greedy replies to one prompt are all the same; give --temperature (e.g. 0.7)")


def _check_synthesis(args) -> None:
    """--synthesize answers its user turns as --regenerate answers the data's: it needs --regenerate."""
    if args.synthesize and not args.regenerate:
        raise UsageError(f"--synthesize {args.synthesize} is set without --regenerate; add --regenerate (the "
                         "verifier that writes the user turns also writes the replies, with its settings)")
    if args.synthesize and args.synthesize_temperature <= 0:
        raise UsageError(f"--synthesize-temperature {args.synthesize_temperature}: greedy user turns are all the "
                         "same; give a temperature above 0 (e.g. 1.0)")


def source_counts(args) -> dict[str, int]:
    """--source-count SOURCE=N as {source: N}; a malformed value or a source that is not given stops here."""
    from common.data.synthesis import SOURCE

    given = set(args.dataset or []) | ({SOURCE} if args.synthesize else set())
    counts: dict[str, int] = {}
    for value in args.source_count or []:
        source, _, number = value.rpartition("=")
        if not number.isdigit() or int(number) < 1 or source not in given:
            raise UsageError(f"--source-count {value}: expected SOURCE=N with N >= 1 and SOURCE one of "
                             f"{', '.join(sorted(given)) or '(no source given)'} (a --dataset value as given, or "
                             "synthesize with --synthesize)")
        counts[source] = int(number)
    return counts


def _check_endpoint(args) -> str | None:
    """--regenerate-endpoint answers (before any data is read); returns the model name it serves."""
    if not args.regenerate_endpoint:
        return None
    if not args.regenerate:
        raise UsageError("--regenerate-endpoint is set without --regenerate; add --regenerate to regenerate the "
                         "responses through it")
    from common.data.responders import check_endpoint

    return check_endpoint(args.regenerate_endpoint)


# --- the fingerprint: what the output depends on ------------------------------------------------------

def _template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return json.dumps(template, sort_keys=True)
    return template or None


def _dataset_identity(spec: str) -> str:
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _fingerprint(args, tokenizer_sha: str, template_sha: str | None, eval_file: Path,
                 served_model: str | None = None) -> dict:
    """The settings the output depends on; a complete output made with other settings is not reused."""
    fingerprint = {
        "model_path": args.model_path, "tokenizer_sha256": tokenizer_sha, "chat_template_sha256": template_sha,
        "datasets": [_dataset_identity(spec) for spec in args.dataset or []], "max_seq_len": args.max_seq_len,
        "num_samples": args.num_samples, "seed": args.seed, "eval_ratio": args.eval_ratio,
        "eval_output": str(eval_file.resolve()) if args.eval_ratio > 0 else None, "regenerate": args.regenerate,
        "max_turns": args.max_turns,
    }
    if args.regenerate:
        fingerprint.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           **generator_identity(args, served_model))
        if args.replies_per_prompt > 1:  # only then, so outputs made before the flag existed stay complete
            fingerprint["replies_per_prompt"] = args.replies_per_prompt
        if args.greedy_first_reply:  # likewise
            fingerprint["greedy_first_reply"] = True
    if args.synthesize:  # likewise
        fingerprint.update({name: getattr(args, name) for name in SYNTHESIS_FLAGS})
    if args.source_count:  # likewise
        fingerprint["source_count"] = sorted(args.source_count)
    return fingerprint


def generator_identity(args, served_model: str | None) -> dict:
    """What generates the responses: the in-process dtype, or the endpoint and the model it serves."""
    if args.regenerate_endpoint:
        from common.data.responders import endpoint_base

        return {"dtype": None, "regenerate_endpoint": endpoint_base(args.regenerate_endpoint),
                "served_model": served_model}
    return {"dtype": args.dtype}


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

