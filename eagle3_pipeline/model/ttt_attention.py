"""Attention of the TTT unroll: causal attention over step 0 merged with per-position diagonal keys (docs/model.md).

The causal part runs on one of PyTorch's private SDPA kernels that also return the log-sum-exp, picked and
self-tested per (device, dtype, head_dim) by `_pick_backend`; `math` is the exact portable fallback.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3_pipeline.model.kernels import CompiledOnCuda, fuse_elementwise, sdpa_without_cudnn, upcast


def expand_heads(x: Tensor, rep: int) -> Tensor:
    """[B,T,nkv,D] -> [B,T,nkv*rep,D] (GQA keys/values repeated for every query head of the group)."""
    if rep == 1:
        return x
    B, T, nkv, D = x.shape
    return x[:, :, :, None, :].expand(B, T, nkv, rep, D).reshape(B, T, nkv * rep, D)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Plain causal attention; q/k/v [B,S,nh,D] -> [B,S,nh,D] (flash / memory-efficient SDPA: cuDNN's would
    build a graph for every new sequence length, most of a training step)."""
    with sdpa_without_cudnn():
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
    lse = torch.empty(B, h, S, dtype=upcast(q[:0]).dtype, device=q.device)
    block = _math_block(B, h, S)
    for s0 in range(0, S, block):
        s1 = min(S, s0 + block)
        scores = torch.matmul(upcast(q[:, :, s0:s1]), upcast(k[:, :, :s1]).transpose(-1, -2)) * scale
        future = torch.arange(s1, device=q.device)[None, :] > torch.arange(s0, s1, device=q.device)[:, None]
        scores.masked_fill_(future, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - block_lse[..., None])
        out[:, :, s0:s1] = torch.matmul(probs, upcast(v[:, :, :s1])).to(q.dtype)
        lse[:, :, s0:s1] = block_lse
    return out, lse


def _causal_math_backward(grad_out, q, k, v, out, lse, scale):
    B, h, S, _ = q.shape
    delta = (upcast(grad_out) * upcast(out)).sum(-1)
    acc = upcast(q[:0]).dtype
    dq = torch.zeros_like(q, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    block = _math_block(B, h, S)
    for s0 in range(0, S, block):
        s1 = min(S, s0 + block)
        qb, kb, vb = upcast(q[:, :, s0:s1]), upcast(k[:, :, :s1]), upcast(v[:, :, :s1])
        gb = upcast(grad_out[:, :, s0:s1])
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
    qg = upcast(q).view(B, S, nkv, rep, D)
    scores = (qg[..., None, :] * upcast(keys)[:, :, :, None]).sum(-1) * scale  # [B,S,nkv,rep,j]
    lse_causal = upcast(lse_c).transpose(1, 2).reshape(B, S, nkv, rep)
    lse = torch.logaddexp(lse_causal, torch.logsumexp(scores, dim=-1))
    weights = (scores - lse[..., None]).exp()
    merged = (weights[..., None] * upcast(values)[:, :, :, None]).sum(-2)
    merged = merged + upcast(out_c).transpose(1, 2).reshape(B, S, nkv, rep, D) * (lse_causal - lse).exp()[..., None]
    return merged.to(q.dtype).view(B, S, nh, D), lse.reshape(B, S, nh)


def _diag_grads(grad_out: Tensor, q: Tensor, keys: Tensor, values: Tensor, out: Tensor, lse: Tensor,
                dq_causal: Tensor, scale: float):
    """Gradients of the diagonal terms (and the full dq) for _diag_merge's output; dq_causal [B,nh,S,D]
    from the causal kernel's backward. Returns (dq [B,S,nh,D], grad_keys, grad_values [B,S,nkv,j,D])."""
    B, S, nh, D = q.shape
    nkv = keys.shape[2]
    rep = nh // nkv
    g = upcast(grad_out).view(B, S, nkv, rep, D)
    qg = upcast(q).view(B, S, nkv, rep, D)
    kf, vf = upcast(keys)[:, :, :, None], upcast(values)[:, :, :, None]  # [B,S,nkv,1,j,D]
    delta = (g * upcast(out).view(B, S, nkv, rep, D)).sum(-1, keepdim=True)
    prob = ((qg[..., None, :] * kf).sum(-1) * scale - upcast(lse).view(B, S, nkv, rep, 1)).exp()  # [...,rep,j]
    grad_values = (prob[..., None] * g[..., None, :]).sum(3)
    dscore = ((g[..., None, :] * vf).sum(-1) - delta) * prob * scale
    grad_keys = (dscore[..., None] * qg[..., None, :]).sum(3)
    dq = upcast(dq_causal).transpose(1, 2).reshape(B, S, nkv, rep, D) + (dscore[..., None] * kf).sum(-2)
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
        qg = upcast(q).view(B, S, nkv, rep, D)
        keys = upcast(torch.stack(diag[0::2], dim=3))  # [B,S,nkv,j,D]
        values = upcast(torch.stack(diag[1::2], dim=3))
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale)  # [B,S,nkv,rep,j]
        lse_c = lse_c.transpose(1, 2).reshape(B, S, nkv, rep).to(qg.dtype)
        lse = torch.logaddexp(lse_c, torch.logsumexp(scores, dim=-1))
        merged = torch.matmul(scores.sub_(lse[..., None]).exp_(), values)  # diagonal part
        merged.addcmul_(upcast(out_c.transpose(1, 2)).reshape(B, S, nkv, rep, D), torch.exp(lse_c - lse)[..., None])
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
        g = upcast(grad_out).view(B, S, nkv, rep, D)
        qg = upcast(q).view(B, S, nkv, rep, D)
        keys = upcast(torch.stack(diag[0::2], dim=3))
        values = upcast(torch.stack(diag[1::2], dim=3))
        delta = (g * upcast(out).view(B, S, nkv, rep, D)).sum(-1, keepdim=True)  # [B,S,nkv,rep,1]
        prob = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale).sub_(lse.view(B, S, nkv, rep, 1)).exp_()
        grad_values = torch.matmul(prob.transpose(-1, -2), g)  # [B,S,nkv,j,D]
        dscore = torch.matmul(g, values.transpose(-1, -2)).sub_(delta).mul_(prob).mul_(scale)
        grad_keys = torch.matmul(dscore.transpose(-1, -2), qg)
        dq = upcast(dq.transpose(1, 2)).reshape(B, S, nkv, rep, D) + torch.matmul(dscore, keys)
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
