"""The training-time-test (TTT) loss: the verifier's target distribution, the soft cross-entropy (or the LK loss,
--loss lk) and its metrics."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from eagle3_pipeline.formats.storage import topk_target_distribution
from eagle3_pipeline.model.drafter import check_ce_grad
from eagle3_pipeline.model.kernels import CompiledOnCuda, upcast

if TYPE_CHECKING:
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.drafter import Eagle3Drafter


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
    acc = upcast(rows[:0]).dtype
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
            nondraft_max[r0:r1] = torch.maximum(nondraft_max[r0:r1], upcast(chunk.max(dim=1).values))
    best = torch.empty(N, dtype=acc, device=device)
    argmax = torch.empty(N, dtype=torch.int64, device=device)
    step = max(1, budget_elems // max(1, Vd))
    for r0 in range(0, N, step):
        part = upcast(probs[r0:r0 + step])
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
    acc = upcast(lg[:0]).dtype
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


def _log_acceptance_rows(lg: Tensor, p: Tensor, tgt_argmax: Tensor, row_w: Tensor, want_grad: bool):
    """The LK loss -log(alpha) per row, alpha = sum_v min(p_v, q_v) with q = softmax(lg): the probability that
    speculative sampling accepts a draft from q when the verifier samples from p (arXiv 2602.23881). Returns
    (loss, lse, hit) and, with want_grad, overwrites lg with the rows' gradient, as _soft_ce_rows does."""
    lse = torch.logsumexp(lg.to(upcast(lg[:0]).dtype), dim=-1)
    q, p32, alpha = _acceptance(lg, p, lse)
    hit = lg.argmax(dim=-1) == tgt_argmax
    if want_grad:
        lg.copy_(_log_acceptance_grad(q, p32, alpha, row_w))
    return -alpha.log(), lse, hit


def _acceptance(lg: Tensor, p: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(q = softmax(lg), p, alpha = sum_v min(p_v, q_v)) in lse's dtype."""
    q = (lg.to(lse.dtype) - lse[..., None]).exp()
    p32 = p.to(lse.dtype)
    return q, p32, torch.minimum(q, p32).sum(dim=-1).clamp(min=1e-20)


def _log_acceptance_grad(q: Tensor, p: Tensor, alpha: Tensor, row_w: Tensor) -> Tensor:
    """d(-log alpha)/d logits = -q * (below - sum(below * q)) / alpha, below = [q < p]: raising a logit helps
    alpha only through the tokens the drafter under-proposes."""
    below = (q < p).to(q.dtype)
    under = (below * q).sum(dim=-1, keepdim=True)
    return -q * (below - under) * (row_w / alpha)[..., None]


def _log_acceptance_grad_of_logits(lg: Tensor, p: Tensor, lse: Tensor, row_w: Tensor) -> Tensor:
    """The LK gradient rows from recomputed logits, as a new tensor (inductor miscompiles writing them back
    into lg in the same graph as the row sums that read it)."""
    return _log_acceptance_grad(*_acceptance(lg, p, lse), row_w).to(lg.dtype)


_LK_GRAD_OF_LOGITS = CompiledOnCuda(_log_acceptance_grad_of_logits)


def _log_acceptance_grad_rows(lg: Tensor, p: Tensor, lse: Tensor, row_w: Tensor) -> Tensor:
    """lg (recomputed logits) overwritten by the LK gradient rows, as _soft_ce_grad_rows."""
    return lg.copy_(_LK_GRAD_OF_LOGITS(lg, p, lse, row_w))


_SOFT_CE_ROWS = CompiledOnCuda(_soft_ce_rows)
_SOFT_CE_GRAD_ROWS = CompiledOnCuda(_soft_ce_grad_rows)
_LK_ROWS = CompiledOnCuda(_log_acceptance_rows)
# --loss: the per-row loss (forward) and its gradient rows (backward without stored logits gradients)
OBJECTIVES = {"kl": (_SOFT_CE_ROWS, _SOFT_CE_GRAD_ROWS), "lk": (_LK_ROWS, _log_acceptance_grad_rows)}


def _ce_positions_per_pass(x: Tensor, draft_vocab: int) -> int:
    """Positions of every sequence per elementwise pass of the soft-CE: all of them when the pass is a
    compiled fused kernel (no fp32 [batch, positions, Vd] intermediate exists), else chunks that bound the
    eager fp32 temporaries. One pass covers the whole batch: a pass per sequence would cost a batch of 13
    short sequences 13 times the launches."""
    if x.is_cuda and not _SOFT_CE_ROWS.failed:
        return 1 << 30
    return max(1, _ce_chunk_rows(draft_vocab) // x.shape[0])


class _DraftSoftCE(torch.autograd.Function):
    """sum over rows of w * loss(target probs, softmax(lm_head(x))) (`objective`: the soft-CE, or the LK loss),
    plus the (non-differentiable) weighted count of rows whose argmax is the target's and those rows themselves
    (bool [B, T], whatever their weight). Rows from T = tgt_probs.shape[1] on get no loss and no gradient; store
    keeps the logits' gradient until backward instead of recomputing it (docs/model.md, soft-CE)."""

    @staticmethod
    def forward(ctx, x, weight, tgt_probs, tgt_argmax, row_w, store, need_grad, gemms, objective="kl"):
        B, S, H = x.shape
        T = tgt_probs.shape[1]
        acc = upcast(x[:0]).dtype
        q_lse = torch.empty(B, T, dtype=acc, device=x.device)
        ce = torch.empty(B, T, dtype=acc, device=x.device)
        hit = torch.empty(B, T, dtype=torch.bool, device=x.device)
        logits = gemms.linear(x.reshape(B * S, H), weight).view(B, S, -1)
        keep = bool(need_grad and store)
        chunk = _ce_positions_per_pass(x, weight.shape[0])
        rows_loss, ctx.grad_rows = OBJECTIVES[objective]
        for r0 in range(0, T, chunk):
            r1 = min(T, r0 + chunk)
            ce[:, r0:r1], q_lse[:, r0:r1], hit[:, r0:r1] = rows_loss(
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
        return (ce * row_w).sum(), (hit.to(row_w.dtype) * row_w).sum(), hit

    @staticmethod
    def backward(ctx, grad_loss, _grad_hit_sum, _grad_hit):
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
                ctx.grad_rows(grad_logits[:, r0:r1], tgt_probs[:, r0:r1], q_lse[:, r0:r1], row_w[:, r0:r1])
            grad_logits[:, T:] = 0
        B, S, H = x.shape
        grad_loss = grad_loss.to(x.dtype)
        grad_rows = grad_logits.view(B * S, -1)
        grad_x, grad_w = gemms.backward(grad_rows, weight, x.reshape(B * S, H))
        grad_x, grad_w = grad_x.mul_(grad_loss).view(B, S, H), grad_w.mul_(grad_loss)
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None, None, None


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
    check_ce_grad(policy)
    if policy != "auto":
        return policy == "store"
    kept_per_row = 8 * cfg.hidden_size + 2 * cfg.intermediate_size
    return cfg.draft_vocab_size <= 0.6 * kept_per_row


def real_loss_mask(batch: dict) -> Tensor:
    """bool [B, S]: loss tokens that are not right padding."""
    device = batch["input_ids"].device
    loss_mask = batch["loss_mask"].to(device=device, dtype=torch.bool)
    if batch.get("attention_mask") is not None:
        loss_mask = loss_mask & batch["attention_mask"].to(device=device, dtype=torch.bool)
    return loss_mask


def ttt_loss(model: Eagle3Drafter, batch: dict, verifier_lm_head: Tensor, ttt_steps: int,
             decay: float = 0.8, noise_std: float = 0.0, hits: list | None = None,
             objective: str = "kl") -> tuple[Tensor, dict]:
    """Training-time-test loss of one batch.

    batch: input_ids Long[B,S], loss_mask [B,S], attention_mask [B,S] (1 valid, 0 right padding),
    aux [B,S,3H], and final [B,S,H] or top-k targets topk_ids/topk_logprobs [B,S,K] (stage 02 --targets topk:
    the target is then the kept draft tokens renormalised, see topk_target_distribution). At step j, position t predicts token t+2+j: its target is the verifier's
    distribution softmax(final[t+1+j] @ lm_head[draft ids].T) over the draft vocabulary; it counts only if
    token t+2+j is a real, loss-masked token and the verifier's full-vocabulary argmax at t+1+j is a draft
    token. Loss = sum_j decay**j * mean soft-CE_j (objective "kl": the forward KL up to a constant; "lk": the
    mean -log acceptance probability instead). Metrics (detached, per step): loss_sum, correct, count.
    `hits`, when given a list, gets step j's correct rows (bool [B, S-2-j]) appended for each step: validation
    walks them as chain decoding would (eagle3_pipeline.train.metrics.walk_chain).
    """
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    device = input_ids.device
    loss_mask = real_loss_mask(batch)
    with torch.autocast(device_type=device.type, enabled=False):
        if "topk_ids" in batch:
            targets = topk_target_distribution(batch["topk_ids"], batch["topk_logprobs"], model.t2d.to(device),
                                               model.draft_token_ids().numel())
        else:
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
                if hits is not None:
                    hits.append(torch.zeros(B, 0, dtype=torch.bool, device=device))
                continue
            row_w = label_ok[:, 1 + j:1 + j + rows].to(upcast(targets["probs"][:0]).dtype)
            normed = model.norm(prenorm)  # all S rows: the CE reads the first `rows` (no slice gradient)
            ce_sum, hit, hit_rows = _DraftSoftCE.apply(
                normed, model.lm_head.weight, targets["probs"][:, 1 + j:1 + j + rows],
                targets["argmax"][:, 1 + j:1 + j + rows], row_w, store, need_grad, model.gemms, objective)
            count = row_w.sum()
            loss = loss + (decay ** j) * ce_sum / count.clamp(min=1.0)
            loss_sums.append(ce_sum.detach()), corrects.append(hit.detach()), counts.append(count)
            if hits is not None:  # (validation only: off the training step's path)
                hits.append(hit_rows & (row_w > 0))
        if loss.grad_fn is None and torch.is_grad_enabled():  # sequences too short for any label
            loss = loss + 0.0 * prenorm.float().sum()
    metrics = {"loss_sum": torch.stack(loss_sums).float(), "correct": torch.stack(corrects).float(),
               "count": torch.stack(counts).float()}
    if "missing_mass" in targets:  # top-k targets: the verifier's probability they leave out, over loss tokens
        metrics["missing_mass_sum"] = (targets["missing_mass"] * loss_mask).sum().float().reshape(1)
        metrics["missing_mass_count"] = loss_mask.sum().float().reshape(1)
    return loss, metrics


def simulated_acceptance_length(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: expected tokens per verify step when step j is accepted w.p. acc_j."""
    total, running = 1.0, 1.0
    for a in acc:
        running *= float(a)
        total += running
    return total
