"""One optimizer step of the drafter (train_step) and one validation pass (evaluate)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from eagle3_pipeline.figures import CHAIN_DRAFTS
from eagle3_pipeline.train.data import collate, to_device
from eagle3_pipeline.train.metrics import add_sums, summarize, walk_chain
from eagle3_pipeline.train.parameters import model_device, trainable_parameters


@dataclass
class TrainConfig:
    """How one optimizer step is computed (what train_step and the benchmark share)."""
    lr: float = 1e-4
    scheduler: str = "cosine"
    warmup_ratio: float = 0.02
    max_grad_norm: float = 0.5
    grad_accum: int = 1
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    noise_std: float = 0.0
    loss: str = "kl"  # the training objective (--loss); validation always reports the soft-CE
    device: str = "cpu"
    dtype: str = "float32"  # the drafter's parameters and computation (bfloat16 on GPU)
    fp8: bool = False  # GEMMs on FP8 tensor cores (Eagle3Drafter.use_fp8); batches padded to FP8_ALIGN


def train_step(model: torch.nn.Module, batch: dict | Sequence[dict], optimizer: torch.optim.Optimizer,
               scheduler, verifier_lm_head: torch.Tensor, cfg: TrainConfig, parallel=None,
               weights: Sequence[float] | None = None) -> dict[str, Any]:
    """One optimizer step over one batch or a list of micro-batches (gradient accumulation).

    Returns "loss" (mean over micro-batches of the TTT loss), "grad_norm" (before clipping), "sums" (per
    TTT step loss_sum/correct/count), "tokens" (real tokens) as device tensors, "lr" (the rate this step
    used) and "finite". The finite-gradient check is the step's one device sync: a non-finite gradient
    skips the update (the step still counts, so the schedule stays aligned).

    On several ranks (`parallel`: eagle3_pipeline.train.data_parallel), `batch` is this rank's part of the step and
    `weights[i]` each micro-batch's share of the step's mean loss over all ranks (0 for a stand-in that only
    takes part in the gradient reduction); "loss", "sums" and "tokens" are then this rank's parts, to be
    summed over the ranks, and "grad_norm" and "finite" are global.
    """
    from eagle3_pipeline.train.loss import ttt_loss

    micro_batches = [batch] if isinstance(batch, dict) else list(batch)
    device = model_device(model)
    model.train()
    if hasattr(model, "gemms"):
        model.gemms.new_step()  # the weights changed in the last optimizer step
    lr = optimizer.param_groups[0]["lr"]
    total_loss = torch.zeros((), device=device)
    sums, tokens = None, torch.zeros((), device=device, dtype=torch.long)
    for index, micro in enumerate(micro_batches):
        micro = to_device(micro, device)  # (an online run's batches are on the device with their states already)
        if parallel is None:
            loss, metrics = ttt_loss(model, micro, verifier_lm_head, cfg.ttt_steps, decay=cfg.ttt_decay,
                                     noise_std=cfg.noise_std, objective=cfg.loss)
            (loss / len(micro_batches)).backward()
            total_loss += loss.detach().float() / len(micro_batches)
        else:
            weight = weights[index]
            last = index == len(micro_batches) - 1  # the backward that reduces the gradients over the ranks
            with nullcontext() if last else parallel.no_sync():
                loss, metrics = parallel.module(micro, verifier_lm_head, cfg.ttt_steps, cfg.ttt_decay, cfg.noise_std,
                                                cfg.loss)
                # DDP and FSDP average over the ranks: scaled so, the result is the step's mean gradient
                (loss * (weight * parallel.world_size)).backward()
            if weight == 0:
                continue
            total_loss += loss.detach().float() * weight
        sums = add_sums(sums, metrics)
        tokens += micro["attention_mask"].sum()
    if parallel is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), cfg.max_grad_norm)
    else:
        grad_norm = parallel.clip_grad_norm(cfg.max_grad_norm)
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if parallel is not None:
        parallel.zero_grad()
    scheduler.step()
    return {"loss": total_loss, "grad_norm": grad_norm.detach(), "sums": sums, "tokens": tokens, "lr": lr,
            "finite": finite}


def _autocast(device: torch.device, amp_dtype: str | None):
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, amp_dtype))


def _as_batches(loader_or_samples: Iterable) -> Iterable[dict]:
    """Batches as they are, or single samples (1-D input_ids) wrapped as batches of one."""
    for item in loader_or_samples:
        yield collate([item]) if item["input_ids"].dim() == 1 else item


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader_or_samples: Iterable, verifier_lm_head: torch.Tensor,
             ttt_steps: int, device: str | torch.device | None = None, decay: float = 0.8,
             reduce: Callable[[dict], dict] | None = None, amp_dtype: str | None = None,
             chain_draft_tokens: int = CHAIN_DRAFTS, chain_max_new_tokens: int | None = None,
             batch_to_device: Callable = to_device) -> dict[str, Any]:
    """Validation metrics of a drafter: per-TTT-step loss and top-1 agreement with the verifier, the
    weighted loss, the TTT acceptance estimate 1 + sum_k prod_{j<=k} acc_j, and the walked chain tau:
    greedy chain decoding with `chain_draft_tokens` drafts a step (SGLang's default, 3) walked over the
    teacher-forced predictions (walk_chain), over each reply's first `chain_max_new_tokens` tokens when given.

    `loader_or_samples`: a DataLoader (or any iterable) of collated batches, or of single samples as
    load_sample returns them. `reduce` all-reduces the sums in a distributed run (it gets None from a rank
    without batches). `amp_dtype` runs the forward under torch.autocast, for callers that keep float32
    weights (no backward here, so the drafter's fused functions are fine with it); stage 04 validates in
    the parameters' own dtype instead. `batch_to_device(batch, device)` moves a batch to the device with its
    states: stored ones decoded (to_device), or computed by the verifier (stage 04 --online,
    eagle3_pipeline.train.online). Used by stage 04's validation and stage 05's --mode eval.
    """
    from eagle3_pipeline.train.loss import real_loss_mask, ttt_loss

    device = torch.device(device) if device is not None else model_device(model)
    was_training = model.training
    model.eval()
    sums = None
    try:
        for batch in _as_batches(loader_or_samples):
            batch = batch_to_device(batch, device)
            hits = []
            with _autocast(device, amp_dtype):
                _, metrics = ttt_loss(model, batch, verifier_lm_head, ttt_steps, decay=decay, noise_std=0.0,
                                      hits=hits)
            walks = walk_chain(hits, real_loss_mask(batch), chain_draft_tokens, chain_max_new_tokens)
            metrics["chain_verify_steps"] = torch.tensor(float(sum(map(len, walks))), device=device)
            metrics["chain_tokens"] = torch.tensor(float(sum(map(sum, walks))), device=device)
            sums = add_sums(sums, metrics)
    finally:
        model.train(was_training)
    if reduce is not None:  # (also on a rank that had no batch: the collective needs every rank)
        sums = reduce(sums)
    return summarize(sums, decay)
