"""A SpecForge-trained drafter written in our checkpoint format, so stage 05 (and SGLang) load it like ours.

SpecForge's LlamaForCausalLMEagle3 and ours share one layout (fc, midlayer.*, norm, lm_head, d2t, t2d, with
SGLang's names), so the export is a copy of those tensors into our Eagle3Drafter and eagle3_pipeline.model.checkpoint's
save_drafter: config.json (the same shape, aux layers and eagle_config as ours) + model.safetensors.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3_pipeline.formats.checkpoint import expected_tensor_specs
from eagle3_pipeline.model.checkpoint import inspect_drafter_dir, save_drafter
from eagle3_pipeline.model.config import DrafterConfig
from eagle3_pipeline.model.drafter import Eagle3Drafter


def specforge_drafter_config(cfg: DrafterConfig) -> dict:
    """The config SpecForge builds its drafter from: the same config.json our checkpoints carry."""
    return cfg.to_sglang_config()


def to_our_drafter(state: dict[str, torch.Tensor], cfg: DrafterConfig) -> Eagle3Drafter:
    """Our Eagle3Drafter holding SpecForge's trained tensors (names and shapes checked, their dtype kept). The
    embedding is not among them (SpecForge does not save the frozen copy; SGLang uses the verifier's)."""
    names = list(expected_tensor_specs(cfg))
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(f"the SpecForge drafter has no {', '.join(missing)}; its layout is not "
                         f"LlamaForCausalLMEagle3's")
    model = Eagle3Drafter(cfg)
    ours = model.state_dict()
    wrong = [f"{name} {tuple(state[name].shape)} != {tuple(ours[name].shape)}" for name in names
             if tuple(state[name].shape) != tuple(ours[name].shape)]
    if wrong:
        raise ValueError("SpecForge's drafter and ours differ in shape: " + "; ".join(wrong))
    model.load_state_dict({name: state[name].detach().to("cpu") for name in names}, strict=False)
    return model.to(state["fc.weight"].dtype)


def export_specforge_drafter(state: dict[str, torch.Tensor], cfg: DrafterConfig, directory: str | Path,
                             extra: dict, data_manifest: dict | None = None, verifier_info=None) -> list[str]:
    """Write the drafter folder atomically and check it as stage 04 checks its own; returns the checker's notes
    (warnings). Raises ValueError with the problems when the folder would not load."""
    save_drafter(to_our_drafter(state, cfg), directory, extra=extra)
    problems, notes = inspect_drafter_dir(directory, data_manifest=data_manifest, verifier_info=verifier_info)
    if problems:
        raise ValueError(f"the exported drafter {directory} fails the checkpoint checks: " + "; ".join(problems))
    return notes
