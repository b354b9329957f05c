"""The drafter's decoder layer started from one of the verifier's (stage 04 --init-from-verifier-layer).

The drafter's layer reads cat(token embedding, fused hidden state) through q/k/v projections of input width
2 x hidden; the verifier's layer reads its residual stream (width hidden). The copy puts the verifier's
projections on the hidden half and zeros on the embedding half, so the layer starts as the verifier's layer
applied to the fused hidden state, and learns from there what the token adds (those weights still get
gradients: the embedding is not zero). Output projection, MLP and both norms are copied as they are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.drafter import Eagle3Drafter


def verifier_layer_shapes(cfg: "DrafterConfig") -> dict[str, tuple[int, ...]]:
    """The shape each verifier tensor (eagle3_pipeline.verifier.loading.LAYER_ROLES) must have to fit this drafter."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
            "gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter),
            "input_layernorm": (H,), "post_attention_layernorm": (H,)}


def layer_shape_problems(cfg: "DrafterConfig", shapes: dict[str, tuple[int, ...]]) -> list[str]:
    return [f"{role} is {tuple(shapes[role])} in the verifier, the drafter needs {want}"
            for role, want in verifier_layer_shapes(cfg).items() if tuple(shapes[role]) != want]


@torch.no_grad()
def init_layer_from_verifier(model: "Eagle3Drafter", tensors: dict[str, Tensor]) -> None:
    """Copy the verifier layer's tensors (by LAYER_ROLES role) into model.midlayer, as the module docstring says."""
    problems = layer_shape_problems(model.config, {role: tuple(t.shape) for role, t in tensors.items()})
    if problems:
        raise ValueError("the verifier's layer does not fit the drafter: " + "; ".join(problems))
    layer, hidden = model.midlayer, model.config.hidden_size
    for role in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(layer.self_attn, role).weight
        weight.zero_()
        weight[:, hidden:].copy_(tensors[role])
    layer.self_attn.o_proj.weight.copy_(tensors["o_proj"])
    for role in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.mlp, role).weight.copy_(tensors[role])
    layer.hidden_norm.weight.copy_(tensors["input_layernorm"])
    layer.post_attention_layernorm.weight.copy_(tensors["post_attention_layernorm"])
