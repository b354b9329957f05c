"""The EAGLE-3 drafter model: one Llama decoder layer at the verifier's width (SGLang's `LlamaForCausalLMEagle3`).

    g      = fc(cat(aux_low, aux_mid, aux_high))                      [B,T,3H] -> [B,T,H]
    a      = cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))   [B,T,2H] -> q/k/v
    h1     = g_t + o_proj(attention(a))                               residual = the hidden, not the embedding
    out    = h1 + mlp(post_attention_layernorm(h1))                   "pre-norm output", fed to the next step
    logits = lm_head(norm(out))                                       over the draft vocabulary [Vd]

`decode` is the inference forward; `ttt_hidden_states` the training-time-test unroll (docs/model.md). Both
use the same RoPE positions: the j-th draft step after the entry of position t runs at position t+j.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3_pipeline.formats.checkpoint import vocab_mapping_problems
from eagle3_pipeline.model.config import DrafterConfig, rope_parameters
from eagle3_pipeline.model.kernels import Bf16Gemms, CompiledOnCuda, Fp8Gemms, fp8_available, fuse_elementwise, linear
from eagle3_pipeline.model.ttt_attention import expand_heads, causal_attention, ttt_attention

# What the soft cross-entropy does with its logits' gradient (set_memory_policy; train/loss.py store_ce_gradients).
CE_GRAD_POLICIES = ("auto", "store", "recompute")


def check_ce_grad(policy: str) -> None:
    if policy not in CE_GRAD_POLICIES:
        raise ValueError(f"ce_grad must be auto, store or recompute, got {policy!r}")


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B,T,heads,D]; cos/sin [B or 1,T,1,D] in x's dtype (neox / HF rotate_half layout, as SGLang)."""
    return x * cos + rotate_half(x) * sin


# Elementwise islands of a TTT step, each one fused kernel each way when compiled (CUDA; autograd through
# torch.compile). A candidate, on only with EAGLE3_FUSE_ELEMENTWISE=1 until it is measured against the
# eager ops on a GPU (scripts/lab/bench_train_step.py --fuse-elementwise); the maths is the same either way.

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
    kernel each way on CUDA (eagle3_pipeline.model.kernels.CompiledOnCuda); the GEMMs go through `gemms` (bf16 or FP8).
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


# RoPE positions of TTT step j for the row of position t: "shifted" = t+j, where decoding runs that draft step
# (SGLang, SpecForge, EAGLE; the default); "fixed" = t at every step, what this project trained with before,
# kept reachable only for an A/B of the two (stage 04 --ttt-positions).
TTT_POSITIONS = ("shifted", "fixed")


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
        self.ttt_positions = "shifted"  # see TTT_POSITIONS
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
        its logits' gradient until backward (see eagle3_pipeline.train.loss.store_ce_gradients)."""
        if mlp_recompute not in ("act", "gate_up", "none"):
            raise ValueError(f"mlp_recompute must be act, gate_up or none, got {mlp_recompute!r}")
        check_ce_grad(ce_grad)
        self.midlayer.mlp.recompute = mlp_recompute
        self.ce_grad = ce_grad

    def use_fp8(self, enabled: bool = True) -> None:
        """Run the training step's GEMMs (fc, q/k/v/o, MLP, lm_head; forward and backward) on FP8 tensor
        cores (eagle3_pipeline.model.kernels.Fp8Gemms). Parameters, gradients, optimizer and inference keep the model's
        dtype."""
        if enabled and not fp8_available(self.fc.weight.device):
            raise RuntimeError(f"--fp8 needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                               f"Hopper, Blackwell); {self.fc.weight.device} has none. Drop --fp8.")
        self.gemms = Fp8Gemms() if enabled else _BF16

    def ttt_hidden_states(self, input_ids: Tensor, aux: Tensor, ttt_steps: int, noise_std: float = 0.0,
                          attention_backend: str | None = None):
        """Yield (j, prenorm_out_j [B,S,H]) for the TTT unroll (docs/model.md).

        Row t of step j is the j-th draft step after position t, which decoding runs at position t+j: its
        query and the keys it adds use RoPE position t+j (self.ttt_positions "shifted"; "fixed" keeps t)."""
        if self.ttt_positions not in TTT_POSITIONS:
            raise ValueError(f"ttt_positions must be one of {TTT_POSITIONS}, got {self.ttt_positions!r}")
        layer = self.midlayer
        attn = layer.self_attn
        B, S = input_ids.shape
        if noise_std > 0:
            aux = aux + noise_std * torch.randn_like(aux)
        hidden = self.fuse(aux)
        position_ids = torch.arange(S, device=hidden.device)[None]
        shift = 1 if self.ttt_positions == "shifted" else 0
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
            cos, sin = self.rope(position_ids + shift * j)
            if fused:
                a = _ATTENTION_INPUT(emb[:, j + 1:j + 1 + S], layer.input_layernorm.weight, hidden,
                                     layer.hidden_norm.weight, layer.hidden_norm.eps)
            else:
                a = torch.cat([emb[:, j + 1:j + 1 + S] * layer.input_layernorm.weight, layer.hidden_norm(hidden)],
                              dim=-1)
            q, k, v = attn.qkv(a, cos, sin, self.gemms, fused)
            if j == 0:
                k0, v0 = expand_heads(k, rep), expand_heads(v, rep)
                out = causal_attention(q, k0, v0, scale)
            else:
                diag += [k, v]
                out = ttt_attention(q, k0, v0, diag, scale, backend=attention_backend)
            hidden = self._after_attention(hidden, out.reshape(B, S, -1), fused)
            yield j, hidden
