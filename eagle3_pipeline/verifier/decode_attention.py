"""The decoding step's attention for grouped K/V heads (GQA models), without copying the heads.

transformers' SDPA attention repeats every K/V head for its group of query heads (`repeat_kv`) whenever
there is an attention mask, and batched regeneration always has one (left padding): at each decoding step
the whole KV cache is copied `groups` times. For one new token per sequence the copy is unnecessary: the
query heads of a group can stand in the query-length dimension of one K/V head, so a single SDPA call with
the same mask gives the same result. Measured on an H200 with SmolLM2-135M (3 K/V heads for 9 query heads),
a batch of 1024, 256 new tokens and a compiled static cache: 11 ms a step against 30 ms with `sdpa`.
Prefill (several query tokens) and models without grouped heads use transformers' `sdpa` unchanged.

The folded step then runs as two batched matmuls around a float32 softmax (matmul_attention): SDPA's
memory-efficient kernel ran it about 5x slower than one read of the cache, the matmuls 1.2-1.7x faster than
that kernel (scripts/lab/bench_decode_attention.py), and stage 01's loop engine 1.37x faster end to end on an H200
(266.3 against 194.9 conversations/s, docs/results/2026-12-02-h200-turns2-matmul.md). The scores are rounded
to the model's dtype before the softmax, as in transformers' eager attention.

On a GPU the folded step runs as one Triton kernel (eagle3_pipeline.verifier.triton_decode) that reads each K/V row
once and leaves out the positions the mask hides: 2.2 against 4.4 ms a step at 1024 x 384 for the matmuls,
and the loop engine 1.17x faster end to end on one H200 (394.3 against 338.0 conversations/s,
docs/results/2026-12-03-h200-triton-decode.md). Where Triton is not installed, and on a CPU, the matmuls run.
EAGLE3_DECODE_ATTENTION (matmul, sdpa: the folded heads in one SDPA call, triton) picks a way instead.
"""
from __future__ import annotations

import importlib.util
import os

NAME = "sdpa_gqa_decode"
# The ways a folded decoding step can run (EAGLE3_DECODE_ATTENTION).
WAYS = ("matmul", "sdpa", "triton")
# The way on a GPU when EAGLE3_DECODE_ATTENTION is unset (on a CPU: matmul).
GPU_DEFAULT = "triton" if importlib.util.find_spec("triton") else "matmul"


def chosen_way(on_gpu: bool) -> str:
    """The way a folded decoding step runs: EAGLE3_DECODE_ATTENTION's, else GPU_DEFAULT on a GPU, else matmul."""
    way = os.environ.get("EAGLE3_DECODE_ATTENTION") or (GPU_DEFAULT if on_gpu else "matmul")
    if way not in WAYS:
        raise ValueError(f"EAGLE3_DECODE_ATTENTION={way!r}: use one of {', '.join(WAYS)}, or unset it")
    return way


def gqa_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, q_len, dim), key/value (batch,
    kv_heads, kv_len, dim); returns (batch, q_len, heads, dim) and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    way = chosen_way(query.is_cuda)
    if dropout != 0.0:
        way = "sdpa"
    output = folded_decode_attention(query, key, value, attention_mask, scaling, way, dropout)
    batch, heads, _, value_dim = output.shape
    return output.reshape(batch, 1, heads, value_dim), None  # one query: the same memory as (batch, heads, 1)


def folded_decode_attention(query, key, value, mask, scaling=None, way: str = "sdpa", dropout: float = 0.0):
    """One decoding step with each group's query heads folded onto their K/V head: query (batch, heads, 1,
    dim), key/value (batch, kv_heads, kv_len, dim) -> (batch, heads, 1, value dim). `way`: one SDPA call,
    "matmul" (matmul_attention), or "triton" (triton_decode; the matmuls for heads or a mask it does not take)."""
    import torch.nn.functional as F

    if way == "triton":
        from eagle3_pipeline.verifier import triton_decode

        if triton_decode.supports(query, key, value, mask):
            return triton_decode.triton_decode_attention(query, key, value, mask, scaling).to(query.dtype)
        way = "matmul"  # the same result
    batch, heads, _, dim = query.shape
    # Query head h belongs to K/V head h // groups (the order repeat_kv gives), so a view groups them.
    grouped = query.view(batch, key.shape[1], heads // key.shape[1], dim)
    if way == "matmul":
        output = matmul_attention(grouped, key, value, mask, scaling)
    else:
        output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return output.reshape(batch, heads, 1, value.shape[-1])


def matmul_attention(query, key, value, mask, scaling=None):
    """softmax(q k^T * scale + mask) v with the scores in float32: query (batch, kv_heads, rows, dim), key and
    value (batch, kv_heads, kv_len, dim); `mask` boolean (True: attend) or additive, broadcast over rows."""
    import torch

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)


def check_triton(model) -> None:
    """Before the first batch, the Triton kernel must build here and agree with the matmuls at the model's heads
    and dtype (triton_decode.problem_with, once per shape). Asked for by EAGLE3_DECODE_ATTENTION=triton, a
    failure stops the run here, naming the fix; as the GPU default, the matmuls take over with a warning, so a GPU
    that Triton cannot serve does not cost the run."""
    global GPU_DEFAULT
    from eagle3_pipeline.log import get_logger
    from eagle3_pipeline.verifier import triton_decode  # registers its op before any step is compiled

    config, parameter = model.config.get_text_config(), next(model.parameters())
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return  # a config without the usual names: each step still asks triton_decode.supports
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    problem = (triton_decode.problem_with(heads, getattr(config, "num_key_value_heads", None) or heads, dim,
                                          parameter.dtype, parameter.device)
               if triton_decode.available() else "Triton needs a CUDA GPU (or TRITON_INTERPRET=1 on a CPU, slowly)")
    if problem is None:
        return
    if os.environ.get("EAGLE3_DECODE_ATTENTION") == "triton":
        raise ValueError(f"EAGLE3_DECODE_ATTENTION=triton: the Triton decoding attention cannot run here ({problem});"
                         " set EAGLE3_DECODE_ATTENTION=matmul")
    get_logger().warning("the Triton decoding attention cannot run here (%s): the matmuls decode instead", problem)
    GPU_DEFAULT = "matmul"


def use_gqa_decode_attention(model) -> None:
    """Register the attention with transformers (once) and switch `model` to it, if it runs on SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", NAME):
        return  # eager or remote code: leave the model's own attention alone
    if chosen_way(next(model.parameters()).is_cuda) == "triton":
        check_triton(model)
    AttentionInterface.register(NAME, gqa_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as sdpa
    model.set_attn_implementation(NAME)
