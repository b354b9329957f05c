"""The EAGLE-3 drafter: model, training-time-test (TTT) loss, optimizer, SGLang export, load and checks.

One Llama decoder layer at the verifier's width (SGLang's `LlamaForCausalLMEagle3`):

    g      = fc(cat(aux_low, aux_mid, aux_high))                      [B,T,3H] -> [B,T,H]
    a      = cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))   [B,T,2H] -> q/k/v
    h1     = g_t + o_proj(attention(a))                               residual = the hidden, not the embedding
    out    = h1 + mlp(post_attention_layernorm(h1))                   "pre-norm output", fed to the next step
    logits = lm_head(norm(out))                                       over the draft vocabulary [Vd]

Training (`ttt_loss`) unrolls `ttt_steps` draft steps over a whole sequence at once. Step j feeds step j-1's
pre-norm output and the tokens one position further on; position ids stay those of step 0, as SpecForge's
OnlineEagle3Model (specforge/core/eagle3.py: position_ids built once before the TTT loop) and SafeAILab's
traineagle3 do. Attention at step j: queries at t see step-0 keys at positions <= t (causal) plus only the
same position's keys from steps 1..j. That is computed as one causal flash attention over the step-0 keys,
plus j per-position "diagonal" scores merged by log-sum-exp, so nothing of size (seq x seq) is ever built
and memory per step is linear in the sequence length (see `ttt_attention`).

Layer-id convention of the exported config (checked in the sources, current main branches):
  * stage 02 stores aux_k = HF output_hidden_states[l_k] = the residual stream ENTERING decoder layer l_k.
  * SGLang reads only `config.eagle_config["eagle_aux_hidden_state_layer_ids"]`
    (python/sglang/srt/model_executor/model_runner.py) and hands them to the verifier's
    `set_eagle3_layers_to_capture`, which stores `layers_to_capture = [id + 1 for id in ids]`
    (python/sglang/srt/models/llama.py, deepseek_v2.py, qwen3*.py, ...: "we plus 1 here because in sglang,
    for the ith layer, it takes the output of the (i-1)th layer"); the model loop appends
    `hidden_states + residual` BEFORE running layer i when i is in layers_to_capture. So SGLang id e
    captures the input of layer e+1: e = l - 1. Without ids it captures before [2, L//2, L-3].
  * vLLM's GPU model runner `_get_eagle3_aux_layers_from_config` (vllm/v1/worker/gpu_model_runner.py)
    reads the TOP-LEVEL `eagle_aux_hidden_state_layer_ids` of the draft config first (newer versions then
    fall back to `eagle_config[...]`) and passes them unchanged to `set_aux_hidden_state_layers`; the
    model loop (vllm/model_executor/models/llama.py, deepseek_v2.py) appends `hidden_states + residual`
    before layer idx when idx is in aux_hidden_state_layers. So vLLM id e captures the input of layer e:
    e = l. Without ids its default is (2, L//2, L-3) too.
  * Exception, SGLang's DeepSeek-V2/V3 family (Kimi-K2/K2.5 included; deepseek_v2.py in SGLang 0.5.23):
    `set_eagle3_layers_to_capture` adds one only when the FIRST id is 1, and otherwise captures the ids as
    written. So for those verifiers e = l - 1 when the first stored layer is 2 (the default [2, 30, 58] ->
    [1, 29, 57], what published Kimi drafters carry) and e = l otherwise; a first layer of 1 cannot be
    captured at all.
  The two conventions conflict by one, so the export writes BOTH: `eagle_config.eagle_aux_hidden_state_
  layer_ids` in SGLang's convention for the verifier's architecture (what SGLang, the deployment target,
  reads) and a top-level `eagle_aux_hidden_state_layer_ids = [l]` (what vLLM reads first, and which SGLang
  never reads). Each server then captures exactly the layers stage 02 stored. `eagle_config_layer_ids` /
  `aux_layers_from_eagle_config` are the one place the SGLang shift lives.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.kernels import Bf16Gemms, CompiledOnCuda, Fp8Gemms, fp8_available, linear

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
METADATA_KEY = "eagle3_pipeline"  # our own provenance block inside config.json (servers ignore it)
LAYER_CONVENTION = "hf_output_hidden_states_index (input of decoder layer)"
FORBIDDEN_CONFIG_KEYS = ("fc_norm", "norm_before_fc", "norm_output")  # EAGLE-3.1 flags: never set them
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl")


# =====================================================================================================
# Layer ids
# =====================================================================================================

# Verifier architectures whose SGLang model class is deepseek_v2.py's (its own layer-id rule, see above).
DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                   "KimiK25ForConditionalGeneration")


def eagle_config_layer_ids(aux_layers: list[int], verifier_architecture: str | None = None) -> list[int]:
    """SGLang `eagle_config` ids that capture the INPUTS of decoder layers `aux_layers` (HF indices).

    SGLang captures before layer id+1 (see the module docstring), so the id is one less than the layer;
    DeepSeek-family verifiers shift only an id list that starts at 1. ValueError when no ids can work.
    """
    layers = [int(layer) for layer in aux_layers]
    if verifier_architecture in DEEPSEEK_FAMILY and layers and layers[0] != 2:
        if layers[0] == 1:
            raise ValueError(f"aux layers {layers}: SGLang cannot capture the input of layer 1 on "
                             f"{verifier_architecture} (its set_eagle3_layers_to_capture shifts ids only when the "
                             f"first one is 1); start the aux layers at 2 or later")
        return layers
    return [layer - 1 for layer in layers]


def aux_layers_from_eagle_config(layer_ids: list[int], verifier_architecture: str | None = None) -> list[int]:
    """Inverse of `eagle_config_layer_ids`: HF output_hidden_states indices SGLang captures for these ids."""
    ids = [int(layer_id) for layer_id in layer_ids]
    if verifier_architecture in DEEPSEEK_FAMILY and ids and ids[0] != 1:
        return ids
    return [layer_id + 1 for layer_id in ids]


# =====================================================================================================
# Config
# =====================================================================================================

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
        """Drafter shape from the verifier's config (common.verifier.loading.VerifierInfo), then `overrides`.

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


# =====================================================================================================
# RoPE
# =====================================================================================================

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


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B,T,heads,D]; cos/sin [B or 1,T,1,D] in x's dtype (neox / HF rotate_half layout, as SGLang)."""
    return x * cos + rotate_half(x) * sin


# Elementwise islands of a TTT step, each one fused kernel each way when compiled (CUDA; autograd through
# torch.compile). A candidate, on only with EAGLE3_FUSE_ELEMENTWISE=1 until it is measured against the
# eager ops on a GPU (scripts/bench_train_step.py --fuse-elementwise); the maths is the same either way.

def _attention_input(emb: Tensor, w_in: Tensor, hidden: Tensor, w_hidden: Tensor, eps: float) -> Tensor:
    """cat(emb * input_layernorm.weight, hidden_norm(hidden)); emb is already normalised."""
    return torch.cat([emb * w_in, F.rms_norm(hidden, (hidden.shape[-1],), w_hidden, eps)], dim=-1)


def _rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _residual_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta) * weight)."""
    h = x + delta
    return h, F.rms_norm(h, (h.shape[-1],), weight, eps)


_ATTENTION_INPUT = CompiledOnCuda(_attention_input)
_ROPE_QK = CompiledOnCuda(_rope_qk)
_RESIDUAL_NORM = CompiledOnCuda(_residual_norm)


def fuse_elementwise() -> bool:
    return os.environ.get("EAGLE3_FUSE_ELEMENTWISE", "0") == "1"


# =====================================================================================================
# Modules
# =====================================================================================================

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and _FUSED_RMS_NORM:
            # one kernel each way; autograd keeps only x and the per-row rstd (the CPU path of F.rms_norm
            # decomposes and keeps an extra [tokens, H] fp32 intermediate)
            return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], self.weight, self.eps)[0]
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) without a weight (computed in fp32, returned in x's dtype)."""
    if x.is_cuda and _FUSED_RMS_NORM:
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)[0]
    return F.rms_norm(x, (x.shape[-1],), None, eps)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _swiglu_grads_(gate: Tensor, up: Tensor, grad_act: Tensor) -> Tensor:
    """Gradients of silu(gate) * up: returns the one w.r.t. up and overwrites grad_act by the one w.r.t.
    gate (grad_act is not needed afterwards; reusing it saves a [tokens, intermediate] buffer)."""
    sig = torch.sigmoid(gate)
    grad_up = gate * sig * grad_act
    # d silu(g)/dg = sig * (1 + g * (1 - sig))
    grad_act.mul_(sig * (1 + gate * (1 - sig)) * up)
    return grad_up


_BF16 = Bf16Gemms()
_SILU_MUL = CompiledOnCuda(_silu_mul)
_SWIGLU_GRADS = CompiledOnCuda(_swiglu_grads_)


class _SwiGLU(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) that keeps only gate(x) and up(x) (or only x) for backward.

    Autograd would also keep silu(gate)*up ([tokens, intermediate], the biggest activation of the layer)
    for every TTT step; it is one cheap elementwise op to recompute. With recompute_gate_up the two
    projections are recomputed as well (more FLOPs, least memory). The elementwise parts are one fused
    kernel each way on CUDA (common.model.kernels.CompiledOnCuda); the GEMMs go through `gemms` (bf16 or FP8).
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, recompute_gate_up: bool, gemms: Bf16Gemms):
        x2 = x.reshape(-1, x.shape[-1])
        gate, up = gemms.linear(x2, w_gate), gemms.linear(x2, w_up)
        out = gemms.linear(_SILU_MUL(gate, up), w_down)
        ctx.recompute_gate_up = recompute_gate_up
        ctx.gemms = gemms
        if recompute_gate_up:
            ctx.save_for_backward(x, w_gate, w_up, w_down)
        else:
            ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        gemms = ctx.gemms
        if ctx.recompute_gate_up:
            x, w_gate, w_up, w_down = ctx.saved_tensors
            x2 = x.reshape(-1, x.shape[-1])
            gate, up = gemms.linear(x2, w_gate), gemms.linear(x2, w_up)
        else:
            x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
            x2 = x.reshape(-1, x.shape[-1])
        # ordered so that at most two [tokens, intermediate] temporaries are alive besides gate and up
        grad_out2 = grad_out.reshape(-1, grad_out.shape[-1])
        _, grad_w_down = gemms.backward(grad_out2, w_down, _SILU_MUL(gate, up), need_input=False)
        grad_act, _ = gemms.backward(grad_out2, w_down, None, need_weight=False)  # -> grad w.r.t. gate below
        grad_up = _SWIGLU_GRADS(gate, up, grad_act)
        grad_x, grad_w_up = gemms.backward(grad_up, w_up, x2)
        del grad_up
        grad_x, grad_w_gate = gemms.backward(grad_act, w_gate, x2, add_input_to=grad_x)
        return grad_x.view(x.shape), grad_w_gate, grad_w_up, grad_w_down, None, None


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.recompute = "act"  # "act" (keep gate/up), "gate_up" (keep only the input), "none" (autograd)

    def forward(self, x: Tensor, gemms: Bf16Gemms | None = None) -> Tensor:
        if not torch.is_grad_enabled() or self.recompute == "none":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return _SwiGLU.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                             self.recompute == "gate_up", gemms or _BF16)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, a: Tensor, cos: Tensor, sin: Tensor, gemms: Bf16Gemms | None = None,
            fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """q [B,T,nh,D], k/v [B,T,nkv,D] (RoPE applied to q and k)."""
        B, T, _ = a.shape
        q = linear(a, self.q_proj.weight, gemms).view(B, T, self.num_heads, self.head_dim)
        k = linear(a, self.k_proj.weight, gemms).view(B, T, self.num_kv_heads, self.head_dim)
        v = linear(a, self.v_proj.weight, gemms).view(B, T, self.num_kv_heads, self.head_dim)
        if fused:
            return (*_ROPE_QK(q, k, cos, sin), v)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class DrafterLayer(nn.Module):
    """SGLang's `midlayer`: the one decoder layer (parameter names match the checkpoint keys)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg.hidden_size, cfg.intermediate_size)


class DrafterCache:
    """Per-layer K/V of previous decode calls ([B, nkv, length, D]); `crop` rolls back after rejection."""

    def __init__(self):
        self.key: Tensor | None = None
        self.value: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Add this call's K/V ([B, nkv, T, D]) and return the full K/V to attend to."""
        if self.key is None:
            self.key, self.value = key, value
        else:
            self.key = torch.cat([self.key, key], dim=2)
            self.value = torch.cat([self.value, value], dim=2)
        return self.key, self.value

    def crop(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a drafter cache of length {self.length} to {length}")
        if self.key is not None:
            self.key = self.key[:, :, :length]
            self.value = self.value[:, :, :length]

    def reorder(self, batch_index: Tensor) -> None:
        """Keep/reorder batch rows (beam or tree bookkeeping)."""
        if self.key is not None:
            self.key = self.key.index_select(0, batch_index)
            self.value = self.value.index_select(0, batch_index)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the verifier's, frozen
        self.fc = nn.Linear(cfg.fc_in_features, H, bias=False)
        self.midlayer = DrafterLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        inv_freq, scale = rope_parameters(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scale = scale
        self._embed_offloaded = False
        self.ce_grad = "auto"  # see set_memory_policy
        self.gemms: Bf16Gemms = _BF16  # training GEMMs; see use_fp8

    # ---- setup ------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_from_verifier(self, embed: Tensor, lm_head: Tensor, d2t: Tensor, t2d: Tensor) -> None:
        """Copy the verifier's embedding; lm_head rows = verifier lm_head rows of the draft vocabulary."""
        cfg = self.config
        if tuple(embed.shape) != (cfg.vocab_size, self.embed_tokens.embedding_dim):
            raise ValueError(f"verifier embedding has shape {tuple(embed.shape)}, expected "
                             f"({cfg.vocab_size}, {self.embed_tokens.embedding_dim})")
        if tuple(lm_head.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"verifier lm_head has shape {tuple(lm_head.shape)}, expected "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        problems = vocab_mapping_problems(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size)
        if problems:
            raise ValueError("vocab mapping: " + "; ".join(problems))
        self.set_vocab_mapping(d2t, t2d)
        self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))
        ids = self.draft_token_ids().to(lm_head.device)
        self.lm_head.weight.copy_(lm_head.index_select(0, ids).to(self.lm_head.weight.dtype))

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def draft_token_ids(self) -> Tensor:
        """Verifier token id of every draft id (ascending), = arange(Vd) + d2t."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_token_ids_cpu(self) -> Tensor:
        """draft_token_ids() on the CPU, cached while d2t is unchanged (saves a device sync per batch)."""
        key = (self.d2t.data_ptr(), self.d2t._version, self.d2t.device)
        if getattr(self, "_draft_ids_cpu_key", None) != key:
            self._draft_ids_cpu = self.draft_token_ids().cpu()
            self._draft_ids_cpu_key = key
        return self._draft_ids_cpu

    def offload_embedding(self) -> None:
        """Keep the frozen [V, H] embedding on the CPU (pinned when CUDA exists), saving V*H*2 bytes of GPU
        memory (2.3 GB for Kimi); lookups gather there and copy the [B, T, H] rows over."""
        weight = self.embed_tokens.weight.detach().to("cpu")
        if torch.cuda.is_available():
            weight = weight.pin_memory()
        self.embed_tokens.weight = nn.Parameter(weight, requires_grad=False)
        self._embed_offloaded = True

    def _apply(self, fn, recurse=True):
        # keep an offloaded embedding where it is when the model moves (model.to("cuda"))
        if not getattr(self, "_embed_offloaded", False):
            return super()._apply(fn, recurse)
        embed = self.embed_tokens
        self._modules["embed_tokens"] = None
        try:
            super()._apply(fn, recurse)
        finally:
            self._modules["embed_tokens"] = embed
        return self

    # ---- pieces -----------------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, input_ids: Tensor) -> Tensor:
        weight = self.embed_tokens.weight
        if weight.device != input_ids.device:  # offloaded: gather on the CPU into pinned memory, copy over
            ids = input_ids.to(weight.device).reshape(-1)
            rows = torch.empty(ids.numel(), weight.shape[1], dtype=weight.dtype,
                               pin_memory=weight.is_pinned())
            torch.index_select(weight, 0, ids, out=rows)
            rows = rows.view(*input_ids.shape, weight.shape[1])
            return rows.to(input_ids.device, non_blocking=True).to(self.compute_dtype)
        return F.embedding(input_ids, weight).to(self.compute_dtype)

    def fuse(self, aux: Tensor) -> Tensor:
        """[B,T,3H] aux hidden states of the verifier -> [B,T,H]."""
        return linear(aux.to(self.compute_dtype), self.fc.weight, self.gemms)

    def rope(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin [B or 1, T, 1, D] in the compute dtype for position ids [B or 1, T]."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(self.compute_dtype)
        sin = (emb.sin() * self.rope_scale).to(self.compute_dtype)
        return cos[:, :, None, :], sin[:, :, None, :]

    def _after_attention(self, hidden: Tensor, attn_out: Tensor, fused: bool = False) -> Tensor:
        layer = self.midlayer
        o = linear(attn_out, layer.self_attn.o_proj.weight, self.gemms)
        if fused:
            norm = layer.post_attention_layernorm
            h1, x = _RESIDUAL_NORM(hidden, o, norm.weight, norm.eps)
        else:
            h1 = hidden + o
            x = layer.post_attention_layernorm(h1)
        return h1 + layer.mlp(x, self.gemms)

    def logits(self, prenorm: Tensor) -> Tensor:
        return self.lm_head(self.norm(prenorm))

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- inference --------------------------------------------------------------------------------

    def decode(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
               cache: DrafterCache | None = None, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One drafter forward over T new positions, attending to `cache` + these positions.

        input_ids [B,T]; hidden [B,T,H] (fuse(aux) from the verifier, or a previous call's pre-norm output);
        position_ids [B,T]; attention_mask: optional bool [B,1,T,past+T] (True = may attend) for tree
        drafting, else causal among the T new positions. Returns (prenorm_out [B,T,H], logits [B,T,Vd]) and
        appends this call's K/V to `cache`.
        """
        layer = self.midlayer
        attn = layer.self_attn
        hidden = hidden.to(self.compute_dtype)
        B, T, _ = hidden.shape
        cos, sin = self.rope(position_ids)
        # input_layernorm computed exactly as in training (normalise, then scale by the weight)
        emb = _rms_normalize(self.embed(input_ids), layer.input_layernorm.eps) * layer.input_layernorm.weight
        a = torch.cat([emb, layer.hidden_norm(hidden)], dim=-1)
        q, k, v = attn.qkv(a, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        rep = attn.num_heads // attn.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.to(torch.bool))
        elif past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        elif T == 1:  # one new position sees the whole cache: no mask to build
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = out.transpose(1, 2).reshape(B, T, -1)
        prenorm = self._after_attention(hidden, out)
        return prenorm, self.logits(prenorm)

    # ---- training ---------------------------------------------------------------------------------

    def set_memory_policy(self, mlp_recompute: str = "act", ce_grad: str = "auto") -> None:
        """mlp_recompute "act": keep gate/up, recompute silu*up (default); "gate_up": keep only the MLP
        input; "none": plain autograd. ce_grad "store" | "recompute" | "auto": whether the soft-CE keeps
        its logits' gradient until backward (see store_ce_gradients)."""
        if mlp_recompute not in ("act", "gate_up", "none"):
            raise ValueError(f"mlp_recompute must be act, gate_up or none, got {mlp_recompute!r}")
        store_ce_gradients(self.config, ce_grad)  # validates
        self.midlayer.mlp.recompute = mlp_recompute
        self.ce_grad = ce_grad

    def use_fp8(self, enabled: bool = True) -> None:
        """Run the training step's GEMMs (fc, q/k/v/o, MLP, lm_head; forward and backward) on FP8 tensor
        cores (common.model.kernels.Fp8Gemms). Parameters, gradients, optimizer and inference keep the model's
        dtype."""
        if enabled and not fp8_available(self.fc.weight.device):
            raise RuntimeError(f"--fp8 needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                               f"Hopper, Blackwell); {self.fc.weight.device} has none. Drop --fp8.")
        self.gemms = Fp8Gemms() if enabled else _BF16

    def ttt_hidden_states(self, input_ids: Tensor, aux: Tensor, ttt_steps: int, noise_std: float = 0.0,
                          attention_backend: str | None = None):
        """Yield (j, prenorm_out_j [B,S,H]) for the TTT unroll (see module docstring)."""
        layer = self.midlayer
        attn = layer.self_attn
        B, S = input_ids.shape
        if noise_std > 0:
            aux = aux + noise_std * torch.randn_like(aux)
        hidden = self.fuse(aux)
        position_ids = torch.arange(S, device=hidden.device)[None]
        cos, sin = self.rope(position_ids)
        # The embedding is frozen: normalise it once (padded by ttt_steps rows for the shifts); each step
        # multiplies its shifted view by the trainable input_layernorm weight, so backward never scatters
        # an [S, H] gradient back into a slice of it.
        with torch.no_grad():
            emb = _rms_normalize(self.embed(input_ids), layer.input_layernorm.eps)
            emb = torch.cat([emb, emb.new_zeros(B, ttt_steps, emb.shape[-1])], dim=1)
        rep = attn.num_heads // attn.num_kv_heads
        scale = attn.head_dim ** -0.5
        k0 = v0 = None
        diag: list[Tensor] = []
        fused = fuse_elementwise()
        for j in range(ttt_steps):
            if fused:
                a = _ATTENTION_INPUT(emb[:, j + 1:j + 1 + S], layer.input_layernorm.weight, hidden,
                                     layer.hidden_norm.weight, layer.hidden_norm.eps)
            else:
                a = torch.cat([emb[:, j + 1:j + 1 + S] * layer.input_layernorm.weight, layer.hidden_norm(hidden)],
                              dim=-1)
            q, k, v = attn.qkv(a, cos, sin, self.gemms, fused)
            if j == 0:
                k0, v0 = _expand_heads(k, rep), _expand_heads(v, rep)
                out = causal_attention(q, k0, v0, scale)
            else:
                diag += [k, v]
                out = ttt_attention(q, k0, v0, diag, scale, backend=attention_backend)
            hidden = self._after_attention(hidden, out.reshape(B, S, -1), fused)
            yield j, hidden


def _expand_heads(x: Tensor, rep: int) -> Tensor:
    """[B,T,nkv,D] -> [B,T,nkv*rep,D] (GQA keys/values repeated for every query head of the group)."""
    if rep == 1:
        return x
    B, T, nkv, D = x.shape
    return x[:, :, :, None, :].expand(B, T, nkv, rep, D).reshape(B, T, nkv * rep, D)


# =====================================================================================================
# TTT attention
# =====================================================================================================

def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Plain causal attention; q/k/v [B,S,nh,D] -> [B,S,nh,D] (flash / memory-efficient SDPA)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=scale)
    return out.transpose(1, 2)


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, diag: list[Tensor], scale: float,
                  backend: str | None = None) -> Tensor:
    """Attention of TTT step j = len(diag) // 2 without an (S x S*(j+1)) mask.

    q [B,S,nh,D]; k0/v0 [B,S,nh,D] (step-0 keys/values, GQA-expanded); diag = [k1, v1, ..., kj, vj] each
    [B,S,nkv,D]. Query t attends to k0[<= t] and to k1[t], ..., kj[t]. The causal part runs as one flash
    attention that also returns its log-sum-exp; the j diagonal scores are merged with it by log-sum-exp
    weights. Backward reuses the flash backward with the MERGED output and log-sum-exp (its softmax
    recomputation then yields the merged probabilities, hence exact gradients), plus elementwise gradients
    for the diagonal terms. Memory: O(S * heads * D) per step.
    """
    backend = backend or _pick_backend(q)
    return _TTTAttention.apply(q, k0, v0, scale, backend, *diag)


def _up(x: Tensor) -> Tensor:
    """fp16/bf16 -> fp32 for accumulation; fp32/fp64 unchanged (tests run the math in fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _causal_forward(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float):
    """(out [B,nh,S,D], lse fp32 [B,nh,S], saved) for q/k/v [B,nh,S,D]."""
    if backend == "flash_cuda":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return res[0], res[1], (res[2], res[3], res[4], res[5], res[6], res[7])
    if backend == "flash_cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    if backend == "cudnn_cuda":  # opt-in (EAGLE3_TTT_ATTENTION) until measured against flash_cuda
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        lse = res[1]  # [B,nh,S] or [B,nh,S,1] depending on the cuDNN frontend
        return res[0], lse.reshape(q.shape[:3]), (res[2], res[3], res[4], res[5], res[6], res[7], tuple(lse.shape))
    if backend == "efficient_cuda":  # its log-sum-exp is padded to a multiple of 32 positions
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True, scale=scale)
        return out, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])
    out, lse = _causal_math_forward(q, k, v, scale)
    return out, lse, ()


def _causal_backward(backend: str, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                     lse: Tensor, saved: tuple, scale: float):
    if backend == "flash_cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
    if backend == "flash_cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True, scale=scale)
    if backend == "cudnn_cuda":
        cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = saved
        no_bias = torch.empty(0, device=q.device, dtype=q.dtype)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.reshape(lse_shape), seed, offset, no_bias, cum_q, cum_k, max_q, max_k, 0.0,
            True, scale=scale)
    if backend == "efficient_cuda":
        seed, offset, padded = saved
        lse_padded = lse.new_zeros(*lse.shape[:-1], padded)
        lse_padded[..., :lse.shape[-1]] = lse
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, torch.empty(0, device=q.device, dtype=q.dtype), out, lse_padded, seed, offset,
            0.0, [True, True, True, False], True, scale=scale)
        return grads[0], grads[1], grads[2]
    return _causal_math_backward(grad_out, q, k, v, out, lse, scale)


def _math_block(B: int, heads: int, S: int) -> int:
    """Query rows per block so a block's fp32 scores stay near 64 MB."""
    return max(1, min(S, (1 << 24) // max(1, B * heads * S)))


def _causal_math_forward(q, k, v, scale):
    B, h, S, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, h, S, dtype=_up(q[:0]).dtype, device=q.device)
    block = _math_block(B, h, S)
    for s0 in range(0, S, block):
        s1 = min(S, s0 + block)
        scores = torch.matmul(_up(q[:, :, s0:s1]), _up(k[:, :, :s1]).transpose(-1, -2)) * scale
        future = torch.arange(s1, device=q.device)[None, :] > torch.arange(s0, s1, device=q.device)[:, None]
        scores.masked_fill_(future, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - block_lse[..., None])
        out[:, :, s0:s1] = torch.matmul(probs, _up(v[:, :, :s1])).to(q.dtype)
        lse[:, :, s0:s1] = block_lse
    return out, lse


def _causal_math_backward(grad_out, q, k, v, out, lse, scale):
    B, h, S, _ = q.shape
    delta = (_up(grad_out) * _up(out)).sum(-1)
    acc = _up(q[:0]).dtype
    dq = torch.zeros_like(q, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    block = _math_block(B, h, S)
    for s0 in range(0, S, block):
        s1 = min(S, s0 + block)
        qb, kb, vb = _up(q[:, :, s0:s1]), _up(k[:, :, :s1]), _up(v[:, :, :s1])
        gb = _up(grad_out[:, :, s0:s1])
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
        future = torch.arange(s1, device=q.device)[None, :] > torch.arange(s0, s1, device=q.device)[:, None]
        probs = torch.exp(scores - lse[:, :, s0:s1, None]).masked_fill_(future, 0.0)
        dv[:, :, :s1] += torch.matmul(probs.transpose(-1, -2), gb)
        dscores = probs * (torch.matmul(gb, vb.transpose(-1, -2)) - delta[:, :, s0:s1, None])
        dq[:, :, s0:s1] = torch.matmul(dscores, kb) * scale
        dk[:, :, :s1] += torch.matmul(dscores.transpose(-1, -2), qb) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _diag_merge(q: Tensor, keys: Tensor, values: Tensor, out_c: Tensor, lse_c: Tensor, scale: float):
    """The diagonal part of a TTT step's attention merged with the causal part, as one elementwise function
    (compiled into a few kernels under EAGLE3_FUSE_ELEMENTWISE=1; the default path is the batched matmuls
    of _TTTAttention.forward, same maths).

    q [B,S,nh,D]; keys/values [B,S,nkv,j,D]; out_c [B,nh,S,D] and lse_c [B,nh,S] from the causal kernel.
    Returns (out [B,S,nh,D] in q's dtype, lse [B,S,nh] in the accumulation dtype)."""
    B, S, nh, D = q.shape
    nkv = keys.shape[2]
    rep = nh // nkv
    qg = _up(q).view(B, S, nkv, rep, D)
    scores = (qg[..., None, :] * _up(keys)[:, :, :, None]).sum(-1) * scale  # [B,S,nkv,rep,j]
    lse_causal = _up(lse_c).transpose(1, 2).reshape(B, S, nkv, rep)
    lse = torch.logaddexp(lse_causal, torch.logsumexp(scores, dim=-1))
    weights = (scores - lse[..., None]).exp()
    merged = (weights[..., None] * _up(values)[:, :, :, None]).sum(-2)
    merged = merged + _up(out_c).transpose(1, 2).reshape(B, S, nkv, rep, D) * (lse_causal - lse).exp()[..., None]
    return merged.to(q.dtype).view(B, S, nh, D), lse.reshape(B, S, nh)


def _diag_grads(grad_out: Tensor, q: Tensor, keys: Tensor, values: Tensor, out: Tensor, lse: Tensor,
                dq_causal: Tensor, scale: float):
    """Gradients of the diagonal terms (and the full dq) for _diag_merge's output; dq_causal [B,nh,S,D]
    from the causal kernel's backward. Returns (dq [B,S,nh,D], grad_keys, grad_values [B,S,nkv,j,D])."""
    B, S, nh, D = q.shape
    nkv = keys.shape[2]
    rep = nh // nkv
    g = _up(grad_out).view(B, S, nkv, rep, D)
    qg = _up(q).view(B, S, nkv, rep, D)
    kf, vf = _up(keys)[:, :, :, None], _up(values)[:, :, :, None]  # [B,S,nkv,1,j,D]
    delta = (g * _up(out).view(B, S, nkv, rep, D)).sum(-1, keepdim=True)
    prob = ((qg[..., None, :] * kf).sum(-1) * scale - _up(lse).view(B, S, nkv, rep, 1)).exp()  # [...,rep,j]
    grad_values = (prob[..., None] * g[..., None, :]).sum(3)
    dscore = ((g[..., None, :] * vf).sum(-1) - delta) * prob * scale
    grad_keys = (dscore[..., None] * qg[..., None, :]).sum(3)
    dq = _up(dq_causal).transpose(1, 2).reshape(B, S, nkv, rep, D) + (dscore[..., None] * kf).sum(-2)
    return dq.to(q.dtype).view(B, S, nh, D), grad_keys.to(keys.dtype), grad_values.to(values.dtype)


_DIAG_MERGE = CompiledOnCuda(_diag_merge)
_DIAG_GRADS = CompiledOnCuda(_diag_grads)


class _TTTAttention(torch.autograd.Function):
    """Causal flash attention over the step-0 keys merged with the per-position diagonal keys of steps 1..j.

    The j diagonal keys/values are stacked to [B,S,nkv,j,D] (a transient copy; backward stacks them again
    rather than keeping it) so the scores, weights and gradients are a few batched matmuls per step
    whatever j is. Scores and merges are computed in fp32.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, scale, backend, *diag):
        B, S, nh, D = q.shape
        nkv = diag[0].shape[2]
        rep = nh // nkv
        out_c, lse_c, saved = _causal_forward(backend, q.transpose(1, 2), k0.transpose(1, 2),
                                              v0.transpose(1, 2), scale)
        ctx.lse_dtype = lse_c.dtype
        ctx.scale, ctx.backend, ctx.saved = scale, backend, saved
        ctx.fused = fuse_elementwise()
        if ctx.fused:
            out, lse = _DIAG_MERGE(q, torch.stack(diag[0::2], dim=3), torch.stack(diag[1::2], dim=3), out_c,
                                   lse_c, scale)
            ctx.save_for_backward(q, k0, v0, out, lse, *diag)
            return out
        qg = _up(q).view(B, S, nkv, rep, D)
        keys = _up(torch.stack(diag[0::2], dim=3))  # [B,S,nkv,j,D]
        values = _up(torch.stack(diag[1::2], dim=3))
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale)  # [B,S,nkv,rep,j]
        lse_c = lse_c.transpose(1, 2).reshape(B, S, nkv, rep).to(qg.dtype)
        lse = torch.logaddexp(lse_c, torch.logsumexp(scores, dim=-1))
        merged = torch.matmul(scores.sub_(lse[..., None]).exp_(), values)  # diagonal part
        merged.addcmul_(_up(out_c.transpose(1, 2)).reshape(B, S, nkv, rep, D), torch.exp(lse_c - lse)[..., None])
        out = merged.to(q.dtype).view(B, S, nh, D)
        ctx.save_for_backward(q, k0, v0, out, lse.reshape(B, S, nh), *diag)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        scale = ctx.scale
        B, S, nh, D = q.shape
        nkv = diag[0].shape[2]
        rep = nh // nkv
        grad_out = grad_out.contiguous()
        lse_t = lse.transpose(1, 2).to(ctx.lse_dtype).contiguous()
        dq, dk0, dv0 = _causal_backward(ctx.backend, grad_out.transpose(1, 2), q.transpose(1, 2),
                                        k0.transpose(1, 2), v0.transpose(1, 2), out.transpose(1, 2), lse_t,
                                        ctx.saved, scale)
        if ctx.fused:
            dq, grad_keys, grad_values = _DIAG_GRADS(grad_out, q, torch.stack(diag[0::2], dim=3),
                                                     torch.stack(diag[1::2], dim=3), out, lse, dq, scale)
            grads = []
            for i in range(len(diag) // 2):
                grads += [grad_keys[:, :, :, i], grad_values[:, :, :, i]]
            return dq, dk0.transpose(1, 2), dv0.transpose(1, 2), None, None, *grads
        g = _up(grad_out).view(B, S, nkv, rep, D)
        qg = _up(q).view(B, S, nkv, rep, D)
        keys = _up(torch.stack(diag[0::2], dim=3))
        values = _up(torch.stack(diag[1::2], dim=3))
        delta = (g * _up(out).view(B, S, nkv, rep, D)).sum(-1, keepdim=True)  # [B,S,nkv,rep,1]
        prob = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale).sub_(lse.view(B, S, nkv, rep, 1)).exp_()
        grad_values = torch.matmul(prob.transpose(-1, -2), g)  # [B,S,nkv,j,D]
        dscore = torch.matmul(g, values.transpose(-1, -2)).sub_(delta).mul_(prob).mul_(scale)
        grad_keys = torch.matmul(dscore.transpose(-1, -2), qg)
        dq = _up(dq.transpose(1, 2)).reshape(B, S, nkv, rep, D) + torch.matmul(dscore, keys)
        grads = []
        for i, (kd, vd) in enumerate(zip(diag[0::2], diag[1::2])):
            grads += [grad_keys[:, :, :, i].to(kd.dtype), grad_values[:, :, :, i].to(vd.dtype)]
        return (dq.view(B, S, nh, D).to(q.dtype), dk0.transpose(1, 2), dv0.transpose(1, 2), None, None, *grads)


_BACKEND_CACHE: dict[tuple, str] = {}


def _pick_backend(q: Tensor) -> str:
    """The causal-attention kernel of the TTT steps: PyTorch's own kernels that also return the log-sum-exp
    (flash_cuda, then efficient_cuda on GPUs; flash_cpu on CPUs), else the chunked exact `math` one.

    Each private aten op is checked once per (device type, dtype, head_dim) against `math` on a small
    problem (values and gradients); an error or a mismatch moves on to the next candidate with a warning.
    EAGLE3_TTT_ATTENTION=math|flash_cuda|efficient_cuda|cudnn_cuda|flash_cpu forces one (cudnn_cuda is only
    used when forced: it is the candidate to measure against flash_cuda on Hopper).
    """
    forced = os.environ.get("EAGLE3_TTT_ATTENTION")
    if forced:
        return forced
    key = (q.device.type, q.dtype, q.shape[-1])
    if key in _BACKEND_CACHE:
        return _BACKEND_CACHE[key]
    candidates = []
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
            candidates.append("flash_cuda")
        candidates.append("efficient_cuda")
    elif q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        candidates.append("flash_cpu")
    chosen = next((c for c in candidates if _self_test_backend(c, q.device, q.dtype, q.shape[-1])), "math")
    _BACKEND_CACHE[key] = chosen
    return chosen


def _self_test_backend(backend: str, device, dtype, head_dim: int) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, S, nh, nkv = 1, 37, 4, 2
    shapes = [(B, S, nh, head_dim)] * 3 + [(B, S, nkv, head_dim)] * 4
    tensors = [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes]
    try:
        with torch.enable_grad():
            results = []
            for name in (backend, "math"):
                for t in tensors:
                    t.grad = None
                out = _TTTAttention.apply(tensors[0], tensors[1], tensors[2], head_dim ** -0.5, name, *tensors[3:])
                (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
                results.append([out.detach().float()] + [t.grad.float().clone() for t in tensors])
        tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
        ok = all(bool(torch.isfinite(a).all()) and float((a - b).norm()) <= tol * float(b.norm()) + 1e-6
                 for a, b in zip(*results))
    except Exception as err:  # noqa: BLE001 - any failure means: use the portable path
        warnings.warn(f"TTT attention backend {backend} unavailable ({type(err).__name__}: {err}); using math")
        return False
    if not ok:
        warnings.warn(f"TTT attention backend {backend} disagrees with the math reference; using math")
    return ok


# =====================================================================================================
# Targets and loss
# =====================================================================================================

@torch.no_grad()
def target_distribution(final: Tensor, verifier_lm_head: Tensor, draft_ids: Tensor, t2d: Tensor,
                        budget_elems: int = 1 << 27, draft_ids_cpu: Tensor | None = None) -> dict[str, Tensor]:
    """The verifier's next-token distribution over the draft vocabulary, per position of `final`.

    final [B,S,H] (post-norm final hidden states), verifier_lm_head [V,H], draft_ids [Vd] ascending
    verifier ids of the draft vocabulary, t2d bool [V]. One pass over the lm_head in vocabulary chunks
    computes the draft columns (gathered from the chunk's logits) and the max over all NON-draft columns,
    never holding [B*S, V]. Returns probs [B,S,Vd] (softmax over the draft vocabulary, in the lm_head's
    dtype), argmax [B,S] (draft id) and in_draft bool [B,S] (the full-vocabulary argmax is a draft token).
    """
    B, S, H = final.shape
    V, Vd = verifier_lm_head.shape[0], draft_ids.numel()
    rows = final.reshape(B * S, H).to(verifier_lm_head.dtype)
    N = rows.shape[0]
    device = rows.device
    draft_ids = draft_ids.to(device)
    if draft_ids_cpu is None:
        draft_ids_cpu = draft_ids.cpu()
    t2d = t2d.to(device)
    acc = _up(rows[:0]).dtype
    probs = torch.empty(N, Vd, dtype=verifier_lm_head.dtype, device=device)  # logits first, then probs
    nondraft_max = torch.full((N,), float("-inf"), dtype=acc, device=device)
    row_chunk = min(N, max(1, budget_elems // 4096))
    vocab_chunk = max(1, budget_elems // max(1, row_chunk))
    for v0 in range(0, V, vocab_chunk):
        v1 = min(V, v0 + vocab_chunk)
        # draft ids are ascending, so the chunk's draft columns are one contiguous range of draft ids
        i0 = int(torch.searchsorted(draft_ids_cpu, v0))
        i1 = int(torch.searchsorted(draft_ids_cpu, v1))
        local_draft = draft_ids[i0:i1] - v0
        mask = t2d[v0:v1]
        weight = verifier_lm_head[v0:v1]
        for r0 in range(0, N, row_chunk):
            r1 = min(N, r0 + row_chunk)
            chunk = rows[r0:r1] @ weight.t()
            if i1 > i0:
                probs[r0:r1, i0:i1] = chunk.index_select(1, local_draft)
            chunk.masked_fill_(mask, float("-inf"))
            nondraft_max[r0:r1] = torch.maximum(nondraft_max[r0:r1], _up(chunk.max(dim=1).values))
    best = torch.empty(N, dtype=acc, device=device)
    argmax = torch.empty(N, dtype=torch.int64, device=device)
    step = max(1, budget_elems // max(1, Vd))
    for r0 in range(0, N, step):
        part = _up(probs[r0:r0 + step])
        best[r0:r0 + step], argmax[r0:r0 + step] = part.max(dim=-1)
        probs[r0:r0 + step] = torch.softmax(part, dim=-1)
    return {"probs": probs.view(B, S, Vd), "argmax": argmax.view(B, S),
            "in_draft": (best >= nondraft_max).view(B, S)}


def _soft_ce_rows(lg: Tensor, p: Tensor, tgt_argmax: Tensor, row_w: Tensor, want_grad: bool):
    """Soft-CE statistics of logits rows lg [..., Vd] against target probabilities p [..., Vd] (any number of
    leading dimensions: [batch, rows] in training).

    Returns (ce, lse, hit) per row (fp32; fp64 for fp64 inputs). With want_grad, lg is overwritten by
    the rows' gradient of sum(row_w * ce) w.r.t. the logits, (softmax(lg) - p) * row_w, in lg's dtype:
    the logits are not needed afterwards, so the gradient reuses their memory.
    """
    acc = _up(lg[:0]).dtype
    lg32, p32 = lg.to(acc), p.to(acc)
    lse = torch.logsumexp(lg32, dim=-1)
    # -sum p log q = lse - sum p * logits   (sum p = 1)
    ce = lse - (lg32 * p32).sum(dim=-1)
    hit = lg32.argmax(dim=-1) == tgt_argmax
    if want_grad:
        lg.copy_(((lg32 - lse[..., None]).exp() - p32) * row_w[..., None])
    return ce, lse, hit


def _soft_ce_grad_rows(lg: Tensor, p: Tensor, lse: Tensor, row_w: Tensor) -> Tensor:
    """lg [..., Vd] (recomputed logits) overwritten by (exp(lg - lse) - p) * row_w, as in _soft_ce_rows."""
    acc = lse.dtype
    lg.copy_(((lg.to(acc) - lse[..., None]).exp() - p.to(acc)) * row_w[..., None])
    return lg


_SOFT_CE_ROWS = CompiledOnCuda(_soft_ce_rows)
_SOFT_CE_GRAD_ROWS = CompiledOnCuda(_soft_ce_grad_rows)


def _ce_positions_per_pass(x: Tensor, draft_vocab: int) -> int:
    """Positions of every sequence per elementwise pass of the soft-CE: all of them when the pass is a
    compiled fused kernel (no fp32 [batch, positions, Vd] intermediate exists), else chunks that bound the
    eager fp32 temporaries. One pass covers the whole batch: a pass per sequence would cost a batch of 13
    short sequences 13 times the launches."""
    if x.is_cuda and not _SOFT_CE_ROWS.failed:
        return 1 << 30
    return max(1, _ce_chunk_rows(draft_vocab) // x.shape[0])


class _DraftSoftCE(torch.autograd.Function):
    """sum over rows of w * soft-CE(target probs, softmax(lm_head(x))), plus the hit count.

    x has S rows per sequence, the targets T <= S: rows from T on get no loss and no gradient. The logits
    of all S rows come from one GEMM (bf16 output, fp32 accumulation, as F.linear; or FP8 through `gemms`,
    which wants whole aligned row counts, hence all S rows); the statistics and the logits' gradient
    (softmax - p) * w come from one elementwise pass over them (`_soft_ce_rows`, compiled on CUDA), which
    writes the gradient over the logits. Backward is then two GEMMs: grad_x = G @ W and grad_W = G^T @ x,
    scaled by the incoming gradient.
    store=True keeps G ([rows, Vd] in x's dtype) from forward to backward; store=False keeps nothing of
    that size and recomputes it in backward (one more GEMM and elementwise pass, less memory).
    Also returns the (non-differentiable) weighted count of rows whose argmax equals the target's argmax.
    """

    @staticmethod
    def forward(ctx, x, weight, tgt_probs, tgt_argmax, row_w, store, need_grad, gemms):
        B, S, H = x.shape
        T = tgt_probs.shape[1]
        acc = _up(x[:0]).dtype
        q_lse = torch.empty(B, T, dtype=acc, device=x.device)
        ce = torch.empty(B, T, dtype=acc, device=x.device)
        hit = torch.empty(B, T, dtype=torch.bool, device=x.device)
        logits = gemms.linear(x.reshape(B * S, H), weight).view(B, S, -1)
        keep = bool(need_grad and store)
        chunk = _ce_positions_per_pass(x, weight.shape[0])
        for r0 in range(0, T, chunk):
            r1 = min(T, r0 + chunk)
            ce[:, r0:r1], q_lse[:, r0:r1], hit[:, r0:r1] = _SOFT_CE_ROWS(
                logits[:, r0:r1], tgt_probs[:, r0:r1], tgt_argmax[:, r0:r1], row_w[:, r0:r1], keep)
        ctx.stored = keep
        ctx.gemms = gemms
        if keep:
            logits[:, T:] = 0  # rows without a target: no gradient
            ctx.save_for_backward(x, weight, logits)
        else:
            del logits
            ctx.save_for_backward(x, weight, tgt_probs, row_w, q_lse)
        ctx.mark_non_differentiable(hit)
        return (ce * row_w).sum(), (hit.to(row_w.dtype) * row_w).sum()

    @staticmethod
    def backward(ctx, grad_loss, _grad_hit):
        gemms = ctx.gemms
        if ctx.stored:
            x, weight, grad_logits = ctx.saved_tensors
        else:
            x, weight, tgt_probs, row_w, q_lse = ctx.saved_tensors
            B, S, H = x.shape
            T = tgt_probs.shape[1]
            grad_logits = gemms.linear(x.reshape(B * S, H), weight).view(B, S, -1)
            chunk = _ce_positions_per_pass(x, weight.shape[0])
            for r0 in range(0, T, chunk):
                r1 = min(T, r0 + chunk)
                _SOFT_CE_GRAD_ROWS(grad_logits[:, r0:r1], tgt_probs[:, r0:r1], q_lse[:, r0:r1], row_w[:, r0:r1])
            grad_logits[:, T:] = 0
        B, S, H = x.shape
        grad_loss = grad_loss.to(x.dtype)
        grad_rows = grad_logits.view(B * S, -1)
        grad_x, grad_w = gemms.backward(grad_rows, weight, x.reshape(B * S, H))
        grad_x, grad_w = grad_x.mul_(grad_loss).view(B, S, H), grad_w.mul_(grad_loss)
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None, None


def _ce_chunk_rows(draft_vocab: int, budget_elems: int = 1 << 25) -> int:
    rows = max(1, budget_elems // max(1, draft_vocab))
    return max(64, rows // 64 * 64)


def store_ce_gradients(cfg: DrafterConfig, policy: str = "auto") -> bool:
    """Whether the soft-CE keeps its logits' gradient ([S, Vd] per TTT step) from forward to backward
    (saves a [S,H]x[H,Vd] GEMM and an elementwise pass per step) instead of recomputing it.

    "auto" keeps it when it adds at most ~60% to what a TTT step keeps anyway (~ S * (8H + 2I) elements:
    attention inputs/outputs, norms, the MLP's gate/up): true for Llama-8B- and Kimi-sized drafters with a
    32K draft vocabulary, false for small ones (SmolLM2), whose memory the logits would dominate.
    """
    if policy in ("store", "recompute"):
        return policy == "store"
    if policy != "auto":
        raise ValueError(f"ce_grad must be auto, store or recompute, got {policy!r}")
    kept_per_row = 8 * cfg.hidden_size + 2 * cfg.intermediate_size
    return cfg.draft_vocab_size <= 0.6 * kept_per_row


def ttt_loss(model: Eagle3Drafter, batch: dict, verifier_lm_head: Tensor, ttt_steps: int,
             decay: float = 0.8, noise_std: float = 0.0) -> tuple[Tensor, dict]:
    """Training-time-test loss of one batch.

    batch: input_ids Long[B,S], loss_mask [B,S], attention_mask [B,S] (1 valid, 0 right padding),
    aux [B,S,3H], final [B,S,H]. At step j, position t predicts token t+2+j: its target is the verifier's
    distribution softmax(final[t+1+j] @ lm_head[draft ids].T) over the draft vocabulary; it counts only if
    token t+2+j is a real, loss-masked token and the verifier's full-vocabulary argmax at t+1+j is a draft
    token. Loss = sum_j decay**j * mean soft-CE_j. Metrics (detached, per step): loss_sum, correct, count.
    """
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    device = input_ids.device
    loss_mask = batch["loss_mask"].to(device=device, dtype=torch.bool)
    if batch.get("attention_mask") is not None:
        loss_mask = loss_mask & batch["attention_mask"].to(device=device, dtype=torch.bool)
    with torch.autocast(device_type=device.type, enabled=False):
        targets = target_distribution(batch["final"], verifier_lm_head, model.draft_token_ids(), model.t2d,
                                      draft_ids_cpu=model.draft_token_ids_cpu())
        # row t of step j is valid when token t+2+j is a loss token and the target at t+1+j is in-vocab
        label_ok = loss_mask[:, 1:] & targets["in_draft"][:, :-1]  # index u = t+1+j, u in [0, S-1)
        zero = torch.zeros((), device=device)
        loss = zero
        loss_sums, corrects, counts = [], [], []
        store = store_ce_gradients(model.config, getattr(model, "ce_grad", "auto"))
        need_grad = torch.is_grad_enabled()
        for j, prenorm in model.ttt_hidden_states(input_ids, batch["aux"], ttt_steps, noise_std):
            rows = S - 2 - j  # positions t = 0 .. S-3-j have a label
            if rows <= 0:
                loss_sums.append(zero), corrects.append(zero), counts.append(zero)
                continue
            row_w = label_ok[:, 1 + j:1 + j + rows].to(_up(targets["probs"][:0]).dtype)
            normed = model.norm(prenorm)  # all S rows: the CE reads the first `rows` (no slice gradient)
            ce_sum, hit = _DraftSoftCE.apply(
                normed, model.lm_head.weight, targets["probs"][:, 1 + j:1 + j + rows],
                targets["argmax"][:, 1 + j:1 + j + rows], row_w, store, need_grad, model.gemms)
            count = row_w.sum()
            loss = loss + (decay ** j) * ce_sum / count.clamp(min=1.0)
            loss_sums.append(ce_sum.detach()), corrects.append(hit.detach()), counts.append(count)
        if loss.grad_fn is None and torch.is_grad_enabled():  # sequences too short for any label
            loss = loss + 0.0 * prenorm.float().sum()
    metrics = {"loss_sum": torch.stack(loss_sums).float(), "correct": torch.stack(corrects).float(),
               "count": torch.stack(counts).float()}
    return loss, metrics


def simulated_acceptance_length(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: expected tokens per verify step when step j is accepted w.p. acc_j."""
    total, running = 1.0, 1.0
    for a in acc:
        running *= float(a)
        total += running
    return total


# =====================================================================================================
# Optimizer
# =====================================================================================================

class DrafterAdamW(torch.optim.Optimizer):
    """AdamW for bf16 (or fp32) parameters with fp32 moments, stepping one parameter chunk at a time.

    bf16 parameters get either fp32 master weights (master_weights=True, 4 more bytes a parameter) or
    stochastic rounding of every update (default): updates of size lr ~ 1e-4 are mostly smaller than
    half a bf16 ulp of the weights and would be rounded away by plain round-to-nearest; stochastic
    rounding keeps them in expectation at no memory cost. fp32 parameters are updated exactly.
    Chunks bound the fp32 temporaries (~4 x chunk x 4 bytes). On CUDA the per-chunk update is one
    torch.compile'd elementwise kernel when compile=True (falls back to eager ops if compiling fails).
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, master_weights: bool = False, stochastic_rounding: bool = True,
                 chunk_elems: int = 1 << 26, compile: bool | str = "auto"):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.stochastic_rounding = stochastic_rounding
        self.chunk_elems = chunk_elems
        self._compile = compile
        self._compiled = None

    def _update_fn(self, device: torch.device):
        if device.type != "cuda" or self._compile is False or self._compiled is _adamw_chunk:
            return _adamw_chunk
        if self._compiled is None:
            compiled = torch.compile(_adamw_chunk, dynamic=True, fullgraph=True)

            def first_call(*args):
                # compilation happens on the first call; any failure there means: eager ops from now on
                try:
                    result = compiled(*args)
                    self._compiled = compiled
                    return result
                except Exception as err:  # noqa: BLE001
                    warnings.warn(f"torch.compile of the optimizer update failed ({type(err).__name__}: "
                                  f"{err}); using eager ops")
                    self._compiled = _adamw_chunk
                    return _adamw_chunk(*args)
            return first_call
        return self._compiled

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if self.master_weights and p.dtype != torch.float32:
                        state["master"] = p.detach().float().clone()
                state["step"] += 1
                step = float(state["step"])
                # per-step scalars stay 0-dim CPU tensors: no host-to-device copy, no recompilation
                lr = torch.tensor(group["lr"], dtype=torch.float64)
                bc1 = torch.tensor(1 - beta1 ** step, dtype=torch.float64)
                bc2 = torch.tensor(1 - beta2 ** step, dtype=torch.float64)
                update = self._update_fn(p.device)
                flat = [t.view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                master = state.get("master")
                master = master.view(-1) if master is not None else None
                rounding = p.dtype == torch.bfloat16 and master is None and self.stochastic_rounding
                for i in range(0, flat[0].numel(), self.chunk_elems):
                    sl = slice(i, i + self.chunk_elems)
                    update(flat[0][sl], flat[1][sl], flat[2][sl], flat[3][sl],
                           master[sl] if master is not None else None, lr, bc1, bc2,
                           beta1, beta2, group["eps"], group["weight_decay"], rounding)
        return loss


def _adamw_chunk(p: Tensor, g: Tensor, m: Tensor, v: Tensor, master: Tensor | None, lr: Tensor, bc1: Tensor,
                 bc2: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                 stochastic: bool) -> None:
    """One AdamW update of a chunk; m/v (and master) fp32, p bf16 or fp32, g in p's dtype."""
    g32 = g.float()
    m.mul_(beta1).add_(g32, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    update = v.div(bc2).sqrt_().add_(eps)
    torch.div(m, update, out=update).mul_(lr / bc1)
    x = master if master is not None else p.float()  # p itself when p is fp32
    if weight_decay:
        x.mul_(1 - lr * weight_decay)
    x.sub_(update)
    if master is not None:
        p.copy_(master)
    elif stochastic:
        p.copy_(_stochastic_round_bf16(x))
    elif p.dtype != torch.float32:  # (fp32 parameters were updated in place as x)
        p.copy_(x)


def _stochastic_round_bf16(x: Tensor) -> Tensor:
    """fp32 -> bf16 rounding up or down with probability proportional to the distance (unbiased)."""
    bits = x.view(torch.int32)
    noise = (torch.rand_like(x) * 65536.0).to(torch.int32)
    rounded = (bits + noise) & -65536  # clear the 16 low bits: truncation after adding U[0, 2^16)
    return rounded.view(torch.float32).to(torch.bfloat16)


def make_optimizer(model: Eagle3Drafter, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0,
                   eps: float = 1e-8, master_weights: bool = False, compile: bool | str = "auto") -> DrafterAdamW:
    """The optimizer stage 04 and the benchmark use: DrafterAdamW over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return DrafterAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        master_weights=master_weights, compile=compile)


def trainable_parameter_count(model: Eagle3Drafter) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# =====================================================================================================
# Export / load / check
# =====================================================================================================

def expected_tensor_specs(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Exact checkpoint keys -> (shape, dtype kind): 'float', 'int64' or 'bool'."""
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


def drafter_state_dict(model: Eagle3Drafter) -> dict[str, Tensor]:
    """The exported tensors (no embed_tokens), contiguous, on the CPU."""
    state = model.state_dict()
    return {name: state[name].detach().to("cpu").contiguous() for name in expected_tensor_specs(model.config)}


def save_drafter(model: Eagle3Drafter, directory, extra: dict | None = None) -> None:
    """Write an SGLang-ready drafter folder atomically: config.json + model.safetensors.

    The folder is built under a temporary name beside `directory` and renamed into place, so a crash
    never leaves a half-written checkpoint under the final name. `extra` is recorded in config.json under
    "eagle3_pipeline" (ignored by the servers).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    config = cfg.to_sglang_config()
    config["torch_dtype"] = str(model.compute_dtype).replace("torch.", "")
    meta = {"aux_layers": list(cfg.aux_layers), "layer_convention": LAYER_CONVENTION,
            "verifier_architecture": cfg.verifier_architecture,
            "sglang_eagle_config_ids": config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")}
    meta.update(extra or {})
    config[METADATA_KEY] = meta
    staging = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(drafter_state_dict(model), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n")
        old = None
        if directory.exists() or directory.is_symlink():
            old = directory.with_name(f".{directory.name}.old{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(staging, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_drafter(directory, embed: Tensor | None = None, device="cpu", dtype=torch.float32) -> Eagle3Drafter:
    """Load a drafter folder (ours or a published LlamaForCausalLMEagle3 one).

    `embed` is the verifier's embedding (common.verifier.loading.read_embedding_tensors); a checkpoint's own
    embed_tokens.weight wins when present. Without either the embedding stays zero (and a warning says so).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    cfg = DrafterConfig.from_sglang_config(config)
    tensors = load_file(str(directory / WEIGHTS_FILE))
    tensors = {_canonical_key(k): v for k, v in tensors.items()}
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    model = model.to_empty(device="cpu")
    model.inv_freq.copy_(rope_parameters(cfg)[0])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.midlayer.mlp.recompute = "act"
        state = {k: v for k, v in tensors.items() if k in expected_tensor_specs(cfg)}
        missing = [k for k in expected_tensor_specs(cfg) if k not in state and k not in ("d2t", "t2d")]
        if missing:
            raise ValueError(f"{directory / WEIGHTS_FILE}: missing tensors {missing}")
        if "d2t" not in state:  # drafters over the full vocabulary have no map
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
            state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        model.load_state_dict(state, strict=False)
        own_embed = tensors.get("embed_tokens.weight")
        source = own_embed if own_embed is not None else embed
        if source is not None:
            model.embed_tokens.weight.copy_(source)
        else:
            warnings.warn(f"{directory}: no embed_tokens in the checkpoint and no verifier embedding given; "
                          "the drafter's embedding is zero")
    model.embed_tokens.weight.requires_grad_(False)
    float_dtype = dtype
    model = model.to(device=device)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            param.data = param.data.to(float_dtype)
    return model


def _canonical_key(name: str) -> str:
    """Published drafters sometimes prefix keys with model. or use layers.0 (vLLM naming)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def vocab_mapping_problems(d2t: Tensor, t2d: Tensor, draft_vocab_size: int, vocab_size: int) -> list[str]:
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


def check_drafter_dir(directory, data_manifest: dict | None = None, verifier_info=None) -> list[str]:
    """Every problem that would stop SGLang from loading this drafter correctly (empty = valid)."""
    return inspect_drafter_dir(directory, data_manifest, verifier_info)[0]


def inspect_drafter_dir(directory, data_manifest: dict | None = None,
                        verifier_info=None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a drafter folder: files, config fields, tensor keys/shapes/dtypes,
    vocabulary map, layer ids against the hidden-state manifest, sizes against the verifier."""
    directory = Path(directory)
    problems: list[str] = []
    notes: list[str] = []
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not directory.is_dir():
        return [f"{directory}: no such folder"], notes
    for path in (config_path, weights_path):
        if not path.is_file():
            problems.append(f"{path}: missing")
    if problems:
        return problems, notes
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        return [f"{config_path}: not valid JSON ({err})"], notes

    # ---- config fields
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"{config_path}: architectures is {config.get('architectures')!r}, expected "
                        f"[{ARCHITECTURE!r}]")
    if config.get("model_type") != "llama":
        problems.append(f"{config_path}: model_type is {config.get('model_type')!r}, expected 'llama'")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"{config_path}: num_hidden_layers is {config.get('num_hidden_layers')!r}, expected 1")
    if config.get("tie_word_embeddings") is not False:
        problems.append(f"{config_path}: tie_word_embeddings must be false")
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "rms_norm_eps", "vocab_size", "draft_vocab_size", "max_position_embeddings"):
        if key not in config:
            problems.append(f"{config_path}: missing {key}")
    if "rope_theta" not in config and "rope_parameters" not in config:
        problems.append(f"{config_path}: missing rope_theta")
    for key in FORBIDDEN_CONFIG_KEYS:
        if key in config:
            problems.append(f"{config_path}: has EAGLE-3.1 flag {key!r}; remove it")
    eagle = config.get("eagle_config")
    sglang_ids = None
    if not isinstance(eagle, dict):
        problems.append(f"{config_path}: missing eagle_config")
    else:
        if eagle.get("use_aux_hidden_state") is not True:
            problems.append(f"{config_path}: eagle_config.use_aux_hidden_state must be true")
        sglang_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if sglang_ids is not None and (not isinstance(sglang_ids, list) or len(sglang_ids) != 3
                                       or not all(isinstance(x, int) for x in sglang_ids)):
            problems.append(f"{config_path}: eagle_config.eagle_aux_hidden_state_layer_ids must be three "
                            f"integers, got {sglang_ids!r}")
            sglang_ids = None
    if problems:
        return problems, notes
    try:
        cfg = DrafterConfig.from_sglang_config(config)
    except (ValueError, TypeError) as err:
        return [f"{config_path}: {err}"], notes

    # ---- layer ids: what each server will capture, as HF output_hidden_states indices
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    # SGLang's id rule depends on the verifier's architecture: the verifier's own, else the one recorded.
    architecture = (getattr(verifier_info, "architecture", None)
                    or ((data_manifest or {}).get("verifier") or {}).get("architecture")
                    or cfg.verifier_architecture)
    sglang_layers = aux_layers_from_eagle_config(sglang_ids, architecture) if sglang_ids else None
    stored = (data_manifest or {}).get("aux_layers")
    if stored is not None:
        stored = [int(x) for x in stored]
        num_layers = ((data_manifest or {}).get("verifier") or {}).get("num_layers")
        default = [2, num_layers // 2, num_layers - 3] if num_layers else None
        sglang_effective = sglang_layers if sglang_layers is not None else default
        vllm_effective = list(vllm_ids) if vllm_ids else (
            list(eagle.get("eagle_aux_hidden_state_layer_ids")) if sglang_ids else default)
        if sglang_effective != stored:
            mismatch = (f"{config_path}: SGLang will capture the inputs of layers {sglang_effective} (eagle_config "
                        f"ids {sglang_ids} on {architecture or 'a Llama-style verifier'}) but the hidden states were "
                        f"stored for layers {stored}")
            try:
                problems.append(f"{mismatch}; eagle_config.eagle_aux_hidden_state_layer_ids must be "
                                f"{eagle_config_layer_ids(stored, architecture)}")
            except ValueError as err:  # nothing to fix in this folder: only vLLM can serve such a drafter
                notes.append(f"{mismatch}: {err}")
        if vllm_effective != stored:
            notes.append(f"{config_path}: vLLM would capture the inputs of layers {vllm_effective}, not the "
                         f"stored {stored}; set the top-level eagle_aux_hidden_state_layer_ids to {stored}")
    elif sglang_layers is not None and vllm_ids and list(vllm_ids) != sglang_layers:
        problems.append(f"{config_path}: SGLang captures layers {sglang_layers} but the top-level (vLLM) ids "
                        f"say {list(vllm_ids)}; they must name the same layers")
    elif sglang_layers is not None and not vllm_ids:
        notes.append(f"{config_path}: no top-level eagle_aux_hidden_state_layer_ids: vLLM would read the "
                     f"eagle_config ids {sglang_ids} as layer inputs (one layer earlier than SGLang)")
    if sglang_ids and min(sglang_ids) < 0:
        notes.append(f"{config_path}: eagle_config id {min(sglang_ids)} < 0 (captures the embeddings)")

    # ---- verifier sizes
    if verifier_info is not None:
        if cfg.vocab_size != verifier_info.vocab_size:
            problems.append(f"{config_path}: vocab_size {cfg.vocab_size} != verifier's {verifier_info.vocab_size}")
        target_h = cfg.target_hidden_size or cfg.hidden_size
        if target_h != verifier_info.hidden_size:
            problems.append(f"{config_path}: hidden size {target_h} != verifier's {verifier_info.hidden_size}")
        num_layers = verifier_info.num_layers
        for layer in (sglang_layers or []):
            if not 0 <= layer < num_layers:
                problems.append(f"{config_path}: captured layer {layer} outside the verifier's 0..{num_layers - 1}")
    manifest_verifier = (data_manifest or {}).get("verifier") or {}
    if manifest_verifier.get("hidden_size") and manifest_verifier["hidden_size"] != (cfg.target_hidden_size or cfg.hidden_size):
        problems.append(f"{config_path}: hidden size {cfg.hidden_size} != the hidden states' "
                        f"{manifest_verifier['hidden_size']}")

    # ---- tensors
    from safetensors import safe_open

    specs = expected_tensor_specs(cfg)
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            names = set(handle.keys())
            tensors_meta = {}
            for name in names:
                sl = handle.get_slice(name)
                tensors_meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
            d2t = handle.get_tensor("d2t") if "d2t" in names else None
            t2d = handle.get_tensor("t2d") if "t2d" in names else None
    except Exception as err:  # noqa: BLE001 - a corrupt file is a problem to report
        return problems + [f"{weights_path}: cannot read ({err})"], notes
    for name in sorted(set(specs) - names):
        problems.append(f"{weights_path}: missing tensor {name!r}")
    for name in sorted(names - set(specs)):
        if name == "embed_tokens.weight":
            notes.append(f"{weights_path}: has embed_tokens.weight (SGLang uses the verifier's embedding)")
        else:
            problems.append(f"{weights_path}: unexpected tensor {name!r} (SGLang would silently skip it)")
    float_dtypes = set()
    for name, (shape, kind) in specs.items():
        if name not in tensors_meta:
            continue
        got_shape, got_dtype = tensors_meta[name]
        if got_shape != shape:
            problems.append(f"{weights_path}: {name} has shape {list(got_shape)}, expected {list(shape)}")
        expected_dtype = {"int64": "I64", "bool": "BOOL"}.get(kind)
        if expected_dtype and got_dtype != expected_dtype:
            problems.append(f"{weights_path}: {name} has dtype {got_dtype}, expected {expected_dtype}")
        if kind == "float":
            if got_dtype not in ("BF16", "F16", "F32"):
                problems.append(f"{weights_path}: {name} has dtype {got_dtype}, expected a float dtype")
            float_dtypes.add(got_dtype)
    if len(float_dtypes) > 1:
        problems.append(f"{weights_path}: mixed float dtypes {sorted(float_dtypes)}")
    if d2t is not None and t2d is not None and tensors_meta["d2t"][1] == "I64" and tensors_meta["t2d"][1] == "BOOL":
        problems += [f"{weights_path}: {p}" for p in
                     vocab_mapping_problems(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size)]
    return problems, notes
