"""What a benchmark report records of its run: the stage name and the flags each mode's settings table shows."""
from __future__ import annotations

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


def recorded_settings(args, extra: dict) -> dict:
    """The recorded flags of args.mode, the drafter checkpoint's folder name, then `extra`."""
    settings = {"mode": args.mode}
    settings.update({key: getattr(args, key, None) for key in _SETTINGS[args.mode]})
    for key in ("allow_overlap", "tau_only"):  # a store_true flag defaults to None
        if key in settings:
            settings[key] = bool(settings[key])
    if args.draft_model_path and Path(args.draft_model_path).exists():
        settings["draft_checkpoint"] = Path(args.draft_model_path).resolve().name
    settings.update(extra)
    return settings


def chosen_settings(settings: dict) -> list[tuple[str, Any]]:
    """A report's settings as a person sets them, (--flag, value) in the recorded order; what the run worked out
    beside them (the device's name, stop tokens, the baselines reused, ...) stays in the JSON."""
    return [("--" + key.replace("_", "-"), settings.get(key)) for key in _SETTINGS.get(settings.get("mode"), ())]
