"""The drafter checkpoint contract (docs/conventions.md): its file names and config keys, the tensors it holds, a
whole folder, the vocabulary map. Saving, loading and the full folder check build the model, so they live in
eagle3_pipeline/model/checkpoint.py."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from eagle3_pipeline.errors import UsageError

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
METADATA_KEY = "eagle3_pipeline"  # our own provenance block inside config.json (servers ignore it)
FORBIDDEN_CONFIG_KEYS = ("fc_norm", "norm_before_fc", "norm_output")  # EAGLE-3.1 flags: never set them
DAMAGED_DRAFTER_FIX = ("copy the drafter folder again from where it came, or use another checkpoint of its run "
                       "(04_train.py writes RUN_DIR/checkpoints/step_N, best and latest; rerun 04_train.py to "
                       "train it again)")


def expected_tensor_specs(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """Exact checkpoint keys -> (shape, dtype kind): 'float', 'int64' or 'bool', for a drafter of shape `cfg` (a
    eagle3_pipeline.model.config.DrafterConfig)."""
    H, D = cfg.hidden_size, cfg.head_dim
    nh, nkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    return {
        "fc.weight": ((H, cfg.fc_in_features), "float"),
        "midlayer.input_layernorm.weight": ((H,), "float"),
        "midlayer.hidden_norm.weight": ((H,), "float"),
        "midlayer.self_attn.q_proj.weight": ((nh * D, 2 * H), "float"),
        "midlayer.self_attn.k_proj.weight": ((nkv * D, 2 * H), "float"),
        "midlayer.self_attn.v_proj.weight": ((nkv * D, 2 * H), "float"),
        "midlayer.self_attn.o_proj.weight": ((H, nh * D), "float"),
        "midlayer.post_attention_layernorm.weight": ((H,), "float"),
        "midlayer.mlp.gate_proj.weight": ((inter, H), "float"),
        "midlayer.mlp.up_proj.weight": ((inter, H), "float"),
        "midlayer.mlp.down_proj.weight": ((H, inter), "float"),
        "norm.weight": ((H,), "float"),
        "lm_head.weight": ((cfg.draft_vocab_size, H), "float"),
        "d2t": ((cfg.draft_vocab_size,), "int64"),
        "t2d": ((cfg.vocab_size,), "bool"),
    }


def check_drafter_readable(directory, flag: str = "drafter folder") -> None:
    """config.json is a JSON object and model.safetensors is whole (its header covers the file, as safetensors
    checks on opening), or a usage error naming the file and how to get a whole one. Headers only: no weights read."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise UsageError(f"{flag} {directory}: no {path.name} there; give a drafter folder (config.json and "
                             "model.safetensors) such as RUN_DIR/checkpoints/best")
    try:
        if not isinstance(json.loads(config_path.read_text(encoding="utf-8")), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UsageError(f"{config_path}: not a readable drafter config ({type(err).__name__}: {err}); the file is "
                         f"damaged: {DAMAGED_DRAFTER_FIX}")
    try:
        with safe_open(str(weights_path), framework="pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise UsageError(f"{weights_path}: not a whole safetensors file ({err}); the file is damaged: "
                         f"{DAMAGED_DRAFTER_FIX}")


def vocab_mapping_problems(d2t: Tensor, t2d: Tensor, draft_vocab_size: int, vocab_size: int) -> list[str]:
    """What is wrong with a d2t/t2d pair (docs/conventions.md, the vocabulary map); empty when nothing."""
    problems = []
    if d2t.dtype != torch.int64:
        problems.append(f"d2t dtype {d2t.dtype}, expected int64")
    if t2d.dtype != torch.bool:
        problems.append(f"t2d dtype {t2d.dtype}, expected bool")
    if tuple(d2t.shape) != (draft_vocab_size,):
        problems.append(f"d2t shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
        return problems
    if tuple(t2d.shape) != (vocab_size,):
        problems.append(f"t2d shape {tuple(t2d.shape)}, expected ({vocab_size},)")
        return problems
    ids = torch.arange(draft_vocab_size) + d2t.to("cpu", torch.int64)
    t2d = t2d.to("cpu", torch.bool)
    if int(t2d.sum()) != draft_vocab_size:
        problems.append(f"t2d marks {int(t2d.sum())} tokens, expected draft_vocab_size {draft_vocab_size}")
    if draft_vocab_size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        problems.append(f"d2t maps draft ids outside the verifier vocabulary [0, {vocab_size})")
        return problems
    if draft_vocab_size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        problems.append("draft ids arange(Vd)+d2t are not strictly ascending")
    if not bool(t2d[ids].all()):
        problems.append(f"{int((~t2d[ids]).sum())} draft ids arange(Vd)+d2t are not marked in t2d")
    return problems
