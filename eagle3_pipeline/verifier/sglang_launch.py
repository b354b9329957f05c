"""The exact SGLang launch command that serves a drafter folder with its verifier, checked against the rules of
the checked SGLang releases (0.5.17 and 0.5.23: patches/sglang_releases.py); docs/conventions.md says why each flag.
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.figures import CHAIN_DRAFTS
from eagle3_pipeline.formats.checkpoint import ARCHITECTURE, CONFIG_FILE, METADATA_KEY, WEIGHTS_FILE
from eagle3_pipeline.formats.layer_ids import captured_layers, eagle_ids_for
from eagle3_pipeline.verifier.sglang_settings import (as_launch_arguments, check_setting_names, installed_sglang_root,
                                                      server_arg_names)

DEFAULT_NUM_STEPS, DEFAULT_TOPK, DEFAULT_NUM_DRAFT_TOKENS = CHAIN_DRAFTS, 1, 4
SM120_ATTENTION_BACKEND = "triton"
SM120_DRAFT_ATTENTION_BACKEND = "triton"
NOT_ON_SM120 = {"trtllm_mla": "SM100-only kernels", "fa3": "Hopper only", "flashmla": "Hopper/SM100 only",
                "fa4": "SM100 only", "cutedsl_mla": "SM100 only", "hpc_ops": "Hopper only"}


def verifier_quantization(raw_config: dict) -> str | None:
    """quant_method of the verifier's quantization_config (top level or its text config), None when dense."""
    for config in (raw_config, raw_config.get("text_config") or {}):
        quant = config.get("quantization_config") if isinstance(config, dict) else None
        if quant:
            return str(quant.get("quant_method") or quant.get("quant_algo") or "quantized")
    return None


@dataclass
class LaunchCommand:
    argv: list[str]
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """The command as one shell line per flag."""
        parts, lines = [shlex.quote(a) for a in self.argv], []
        head = next(i for i, a in enumerate(self.argv) if a.startswith("--"))
        lines.append(" ".join(parts[:head]))
        i = head
        while i < len(parts):
            takes_value = i + 1 < len(parts) and not self.argv[i + 1].startswith("--")
            lines.append("    " + " ".join(parts[i:i + (2 if takes_value else 1)]))
            i += 2 if takes_value else 1
        return " \\\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"argv": self.argv, "command": self.shell(), "notes": self.notes, "problems": self.problems}


def read_drafter_config(drafter_dir: str | Path) -> dict:
    path = Path(drafter_dir) / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{drafter_dir}: no config.json; give a drafter folder such as RUN_DIR/checkpoints/best")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON ({err})")
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise UsageError(f"{path}: architectures {config.get('architectures')} do not include {ARCHITECTURE}")
    if not (Path(drafter_dir) / WEIGHTS_FILE).is_file():
        raise UsageError(f"{drafter_dir}: no model.safetensors next to config.json")
    return config


def trained_layers(config: dict) -> list[int] | None:
    """The layers the drafter's training data came from (HF output_hidden_states indices), when recorded."""
    recorded = (config.get(METADATA_KEY) or {}).get("aux_layers")
    if recorded:
        return [int(x) for x in recorded]
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")  # top level: vLLM's convention, the layers as such
    return [int(x) for x in vllm_ids] if vllm_ids else None


def check_extra_settings(settings: dict[str, Any], argv: list[str], notes: list[str]) -> None:
    """Extra server arguments neither repeat one the command already sets nor (where SGLang is installed here) name
    an argument the installed release lacks."""
    already = {a[2:].replace("-", "_"): a for a in argv if a.startswith("--")}
    reserved = {name: f"the command sets {flag}; use this script's own flag" for name, flag in already.items()}
    sglang_root = installed_sglang_root()
    if sglang_root is None:
        for name in settings:
            if name in reserved:
                raise UsageError(f"--sglang-arg {name}: {reserved[name]}")
        notes.append(f"SGLang is not installed here: the extra settings {sorted(settings)} were not checked against "
                     f"its server arguments")
        return
    from patches import installed_sglang_version

    check_setting_names(settings, server_arg_names(sglang_root), installed_sglang_version() or "?", reserved)


def build_launch_command(drafter_dir: str | Path, model_path: str, tp_size: int = 8,
                         num_steps: int = DEFAULT_NUM_STEPS, topk: int = DEFAULT_TOPK,
                         num_draft_tokens: int | None = DEFAULT_NUM_DRAFT_TOKENS,
                         attention_backend: str = SM120_ATTENTION_BACKEND,
                         draft_attention_backend: str = SM120_DRAFT_ATTENTION_BACKEND,
                         trust_remote_code: bool | None = None, port: int | None = None,
                         sm100: bool = False, settings: dict[str, Any] | None = None) -> LaunchCommand:
    """`python -m sglang.launch_server ...` for this drafter and verifier, with notes and problems. `sm100`: the
    server's GPUs are SM100 (B200/GB200), where a quantized verifier needs the drafter marked unquantized.
    `settings`: more server arguments ({name: value}, eagle3_pipeline/verifier/sglang_settings.py), appended."""
    from eagle3_pipeline.verifier.loading import read_raw_config, read_verifier_info, resolve_model_path

    config = read_drafter_config(drafter_dir)
    folder, gguf_file = resolve_model_path(model_path)
    if gguf_file is not None:
        raise UsageError(f"--model-path {model_path}: SGLang serves a Hugging Face folder, not a GGUF file")
    raw = read_raw_config(model_path, bool(trust_remote_code))
    info = read_verifier_info(model_path, bool(trust_remote_code), with_tokenizer_hash=False)
    notes, problems = [], []

    if topk == 1:
        wanted = num_steps + 1
        if num_draft_tokens not in (None, wanted):
            problems.append(f"--num-draft-tokens {num_draft_tokens}: with top-1 (chain) drafting SGLang uses "
                            f"num_steps + 1 = {wanted}")
        num_draft_tokens = wanted
    elif num_draft_tokens is None:
        raise UsageError("--topk > 1 (tree drafting) needs --num-draft-tokens")

    for flag, backend in (("--attention-backend", attention_backend),
                          ("--draft-attention-backend", draft_attention_backend)):
        if backend in NOT_ON_SM120:
            notes.append(f"{flag} {backend}: does not run on SM120 GPUs ({NOT_ON_SM120[backend]}); fine elsewhere")

    argv = ["python", "-m", "sglang.launch_server", "--model-path", folder, "--tp-size", str(tp_size)]
    remote = trust_remote_code if trust_remote_code is not None else bool(raw.get("auto_map"))
    if remote:
        argv.append("--trust-remote-code")
        if trust_remote_code is None:
            notes.append("--trust-remote-code: the verifier's config.json has an auto_map (its own config/tokenizer "
                         "code, as Kimi-K2.5's tiktoken tokenizer)")
    argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", os.path.abspath(drafter_dir),
             "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(topk),
             "--speculative-num-draft-tokens", str(num_draft_tokens)]
    quant = verifier_quantization(raw)
    if quant and sm100:
        argv += ["--speculative-draft-model-quantization", "unquant"]
        notes.append(f"the verifier is quantized ({quant}) and the GPUs are SM100: there SGLang sets --quantization "
                     f"from the checkpoint for DeepSeek-family verifiers, and the drafter's quantization follows "
                     f"--quantization unless told unquant (the bf16 drafter would not load)")
    elif quant:
        notes.append(f"the verifier is quantized ({quant}); the bf16 drafter needs no quantization flag here: its "
                     f"quantization follows --quantization, which is unset (SGLang reads the checkpoint's setting "
                     f"into --quantization only on SM100; pass sm100 / --sm100 there)")
    argv += ["--attention-backend", attention_backend, "--speculative-draft-attention-backend",
             draft_attention_backend]
    if port is not None:
        argv += ["--port", str(port)]
    if settings:
        check_extra_settings(settings, argv, notes)
        argv += as_launch_arguments(settings)

    eagle_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    captured = captured_layers(info.architecture, eagle_ids, info.num_layers)
    trained = trained_layers(config)
    ids_text = f"eagle_config ids {eagle_ids}" if eagle_ids else "no eagle_config ids (SGLang's default)"
    if trained is None:
        notes.append(f"{ids_text}: SGLang will capture the inputs of layers {captured}; the drafter records no "
                     f"training layers, so this could not be checked")
    elif captured != trained:
        right = eagle_ids_for(info.architecture, trained)
        fix = (f"set eagle_config.eagle_aux_hidden_state_layer_ids to {right} in {Path(drafter_dir) / CONFIG_FILE}"
               if right is not None else "no eagle_config ids make this SGLang capture them: retrain on layers "
               "whose first is not 1")
        problems.append(f"{ids_text}: SGLang would capture the inputs of layers {captured} of this "
                        f"{info.architecture}, but the drafter was trained on layers {trained}; {fix}")
    else:
        notes.append(f"{ids_text}: SGLang captures the inputs of layers {captured} of this {info.architecture}, the "
                     f"layers the drafter was trained on")
    trained_steps = ((config.get(METADATA_KEY) or {}).get("training") or {}).get("ttt_steps")
    if trained_steps and num_steps > trained_steps:
        notes.append(f"--num-steps {num_steps}: the drafter was trained to draft {trained_steps} steps "
                     f"(--ttt-steps {trained_steps}); drafts past step {trained_steps} were never trained and are "
                     f"accepted less often. Serve with --num-steps {trained_steps}, or retrain with --ttt-steps "
                     f"{num_steps}")
    if config.get("vocab_size") not in (None, info.vocab_size):
        problems.append(f"the drafter's vocab_size {config.get('vocab_size')} is not the verifier's {info.vocab_size}")
    target_hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if target_hidden not in (None, info.hidden_size):
        problems.append(f"the drafter expects hidden states of width {target_hidden}, the verifier's are "
                        f"{info.hidden_size}")
    return LaunchCommand(argv, notes, problems)
