"""The drafter's shape (DrafterConfig), its config.json mapping, --drafter-config overrides and RoPE tables."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3_pipeline.formats.checkpoint import ARCHITECTURE, METADATA_KEY
from eagle3_pipeline.formats.layer_ids import aux_layers_from_eagle_config, eagle_config_layer_ids

# Verifier model types with MLA attention, which has no Llama equivalent (see DrafterConfig.from_verifier).
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl")


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # the verifier's
    draft_vocab_size: int
    aux_layers: list[int]  # HF output_hidden_states indices stage 02 stored ([] when unknown)
    target_hidden_size: int | None = None
    verifier_architecture: str | None = None  # decides SGLang's layer-id convention (None: Llama's)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        self.aux_layers = [int(x) for x in (self.aux_layers or [])]
        rope_parameters(self)  # fail early on an unsupported RoPE type

    @property
    def fc_in_features(self) -> int:
        return 3 * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_verifier(cls, info, draft_vocab_size: int, aux_layers: list[int], **overrides) -> "DrafterConfig":
        """Drafter shape from the verifier's config (eagle3_pipeline.verifier.loading.VerifierInfo), then `overrides`.

        Llama-like verifiers: heads, KV heads, head_dim, intermediate size and RoPE are the verifier's.
        MLA verifiers (DeepSeek-V2/V3, Kimi-K2/K2.5): their attention has no Llama equivalent, so the
        drafter follows SpecForge's published Kimi-K2/K2.5 EAGLE-3 config (configs/kimi-k25-eagle3.json:
        the verifier's heads and KV heads, head_dim 128, the verifier's dense intermediate size, plain RoPE
        without the verifier's YaRN scaling, which applies to MLA's 64-dim rope part only).
        """
        mla = info.model_type in _MLA_MODEL_TYPES or info.head_dim * info.num_attention_heads != info.hidden_size
        values: dict[str, Any] = dict(
            hidden_size=info.hidden_size,
            num_attention_heads=info.num_attention_heads,
            num_key_value_heads=info.num_key_value_heads,
            head_dim=128 if mla else info.head_dim,
            intermediate_size=info.intermediate_size,
            rms_norm_eps=info.rms_norm_eps,
            rope_theta=info.rope_theta,
            rope_scaling=None if mla else info.rope_scaling,
            max_position_embeddings=info.max_position_embeddings,
            vocab_size=info.vocab_size,
            draft_vocab_size=int(draft_vocab_size),
            aux_layers=list(aux_layers),
            verifier_architecture=info.architecture,
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown drafter config override(s) {sorted(unknown)}; valid: "
                             f"{[f.name for f in fields(cls)]}")
        values.update(overrides)
        return cls(**values)

    def to_sglang_config(self) -> dict:
        """config.json content SGLang (and vLLM) load as LlamaForCausalLMEagle3."""
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": True,
        }
        if self.target_hidden_size is not None:
            config["target_hidden_size"] = self.target_hidden_size
        eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
        if self.aux_layers:
            try:
                ids = eagle_config_layer_ids(self.aux_layers, self.verifier_architecture)
            except ValueError:  # no ids make SGLang capture these; vLLM still reads the top-level ones below
                ids = eagle_config_layer_ids(self.aux_layers)
            eagle_config["eagle_aux_hidden_state_layer_ids"] = ids
            # vLLM reads this top-level key first and takes it as written (input of layer id).
            config["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
        config["eagle_config"] = eagle_config
        return config

    @classmethod
    def from_sglang_config(cls, config: dict) -> "DrafterConfig":
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
                   if k not in config]
        if missing:
            raise ValueError(f"drafter config has no {', '.join(missing)}")
        heads = int(config["num_attention_heads"])
        eagle = config.get("eagle_config") or {}
        architecture = (config.get(METADATA_KEY) or {}).get("verifier_architecture")
        if eagle.get("eagle_aux_hidden_state_layer_ids"):
            aux = aux_layers_from_eagle_config(eagle["eagle_aux_hidden_state_layer_ids"], architecture)
        else:
            aux = list(config.get("eagle_aux_hidden_state_layer_ids") or [])
        theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=config.get("rope_scaling") or None,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
            aux_layers=aux,
            target_hidden_size=config.get("target_hidden_size"),
            verifier_architecture=architecture,
        )


def parse_drafter_overrides(value: str | None) -> dict:
    """--drafter-config: a JSON file or an inline JSON object of DrafterConfig fields ({} when unset)."""
    if not value:
        return {}
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--drafter-config {value}: neither a JSON object nor an existing file")
        text = path.read_text()
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--drafter-config {value}: not valid JSON ({err})")
    if not isinstance(overrides, dict):
        raise ValueError(f"--drafter-config {value}: expected a JSON object of DrafterConfig fields")
    valid = {f.name for f in fields(DrafterConfig)} - {"vocab_size", "draft_vocab_size", "aux_layers"}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"--drafter-config: unknown field(s) {unknown}; valid: {sorted(valid)}")
    return overrides


def rope_parameters(cfg: DrafterConfig) -> tuple[Tensor, float]:
    """(inv_freq fp32 [head_dim/2], cos/sin scale) for the drafter's RoPE.

    default / linear / llama3 / yarn (without DeepSeek's mscale keys) are supported: for those SGLang's
    get_rope and transformers' rope init functions agree. Other types stop with an error rather than
    train with a RoPE the server would compute differently.
    """
    dim = cfg.head_dim
    base = float(cfg.rope_theta)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported for the drafter (supported: default, "
                         "linear, llama3, yarn); pass rope_scaling=null through --drafter-config")
    if kind == "yarn" and any(k in scaling for k in ("mscale", "mscale_all_dim", "attention_factor")):
        raise ValueError("rope_scaling yarn with mscale/mscale_all_dim/attention_factor is computed "
                         "differently by SGLang's LlamaForCausalLMEagle3; pass rope_scaling=null or a plain "
                         "yarn config through --drafter-config")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in scaling.items() if k != "type"}
    params["rope_type"] = kind
    params["rope_theta"] = base
    hf_config = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                            rope_parameters=params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](hf_config, None)
    return inv_freq.float(), float(factor)
