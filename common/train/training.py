"""The optimizer and learning-rate schedule of stage 04 (the rest of stage 04's training: common.train.data,
step, trainer, checkpoints, metrics; see docs/training.md)."""
from __future__ import annotations

import math

import torch

from common.train.parameters import trainable_parameters

BETAS = (0.9, 0.95)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW (0.9, 0.95) over the trainable parameters (the frozen embedding is left out): the drafter's
    DrafterAdamW, with fp32 moments, and fp32 master weights when the parameters are narrower."""
    from common.model.drafter import make_optimizer as drafter_adamw

    params = trainable_parameters(model)
    if not params:
        raise ValueError("the drafter has no trainable parameters")
    narrow = any(p.dtype != torch.float32 for p in params)
    return drafter_adamw(model, lr, betas=BETAS, weight_decay=weight_decay, master_weights=narrow)


class _LrFactor:
    """Linear warmup to 1, then cosine or linear decay to 0, or constant. A class (not a lambda) so that
    the scheduler's state_dict carries it."""

    def __init__(self, kind: str, total_steps: int, warmup_steps: int):
        if kind not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown scheduler {kind!r}")
        self.kind, self.total_steps, self.warmup_steps = kind, max(total_steps, 1), warmup_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 1.0)
        if self.kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float = 0.0,
                   kind: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    warmup_steps = int(round(warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _LrFactor(kind, total_steps, warmup_steps))
