"""The drafter's optimizer (DrafterAdamW and its one factory) and the learning-rate schedule."""
from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

BETAS = (0.9, 0.95)


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



def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0, *,
                   master_weights: bool | None = None, betas=BETAS, eps: float = 1e-8,
                   compile: bool | str = "auto") -> DrafterAdamW:
    """AdamW (0.9, 0.95) over the trainable parameters (the frozen embedding is left out), with fp32 moments.

    master_weights None (stage 04): fp32 master weights when the parameters are narrower than fp32; False:
    stochastic rounding of bf16 updates instead; True: master weights always.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the drafter has no trainable parameters")
    if master_weights is None:
        master_weights = any(p.dtype != torch.float32 for p in params)
    return DrafterAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        master_weights=master_weights, compile=compile)


def trainable_parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


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
