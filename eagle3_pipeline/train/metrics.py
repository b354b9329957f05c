"""Training and validation metrics: sums and counts per TTT step, their summary, the moving window of
training steps, and metrics.jsonl / TensorBoard."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3_pipeline.formats.files import write_text_atomic
from eagle3_pipeline.log import get_logger

METRICS_FILE = "metrics.jsonl"


def add_sums(total: dict[str, torch.Tensor] | None, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`total` plus one batch's per-TTT-step loss_sum/correct/count (float64, still on the device)."""
    parts = {key: metrics[key].detach().double() for key in ("loss_sum", "correct", "count", "missing_mass_sum",
                                                             "missing_mass_count", "chain_verify_steps",
                                                             "chain_tokens") if key in metrics}
    if total is None:
        return parts
    return {key: total[key] + parts[key] for key in parts}


def summarize(sums: dict[str, torch.Tensor] | None, decay: float) -> dict[str, Any]:
    """Per-step loss and top-1 agreement, the decay-weighted loss, and the TTT acceptance estimate (sim_accept_len)."""
    from eagle3_pipeline.train.loss import simulated_acceptance_length

    if sums is None:
        return {"loss": float("nan"), "loss_per_step": [], "acc_per_step": [], "count_per_step": [],
                "sim_accept_len": float("nan"), "tokens": 0}
    count = sums["count"].double().cpu()
    safe = count.clamp(min=1)
    loss_per_step = (sums["loss_sum"].double().cpu() / safe).tolist()
    acc_per_step = (sums["correct"].double().cpu() / safe).tolist()
    weights = [decay ** j for j in range(len(loss_per_step))]
    return {
        "loss": float(sum(w * l for w, l in zip(weights, loss_per_step))),
        "loss_per_step": [round(x, 6) for x in loss_per_step],
        "acc_per_step": [round(x, 6) for x in acc_per_step],
        "count_per_step": [int(x) for x in count.tolist()],
        "sim_accept_len": float(simulated_acceptance_length(acc_per_step)),
        "tokens": int(count[0].item()) if len(count) else 0,
        # top-k targets: the verifier's probability mass the stored tokens leave out (mean over loss tokens)
        **({"target_missing_mass": round(float(sums["missing_mass_sum"].sum() / sums["missing_mass_count"].sum()
                                               .clamp(min=1)), 6)} if "missing_mass_sum" in sums else {}),
        # validation only: chain decoding walked over the teacher-forced predictions (walk_chain)
        **({"sim_chain_tau": round(float(sums["chain_tokens"].sum() / sums["chain_verify_steps"].sum().clamp(min=1)),
                                   6), "chain_verify_steps": int(sums["chain_verify_steps"].sum())}
           if "chain_tokens" in sums else {}),
    }


def walk_chain(hits: list[torch.Tensor], loss_mask: torch.Tensor, draft_tokens: int,
               max_new_tokens: int | None = None) -> list[list[int]]:
    """Tokens of each verify step of greedy chain decoding with `draft_tokens` drafts a step, walked over
    teacher-forced predictions: what decoding these very sequences would accept, without decoding them.
    One list per sequence, each entry accepted drafts + 1 (as stage 05's accept lengths).

    hits[j] bool [B, S-2-j]: row t of TTT step j predicted token t+2+j (ttt_loss's `hits`); loss_mask [B, S].
    A verify step sits at t when token t+1 (the verifier's own) and t+2 (the first draft) are loss tokens; it
    accepts the leading correct drafts and the next one sits at the verifier's new token. Unlike
    1 + sum_k prod_j acc_j, this keeps easy and hard stretches together as decoding meets them: it crosses an
    easy stretch in few verify steps and spends one on every hard token (docs/training.md, validation).
    max_new_tokens: walk only the verify steps that decoding with that budget per reply (a run of loss
    tokens) makes: the step at t comes while fewer than the budget are out, i.e. token t+1 is among the
    reply's first max_new_tokens - 1.
    """
    batch, width = loss_mask.shape[0], loss_mask.shape[1] - 2
    if width <= 0:
        return [[] for _ in range(batch)]
    accepted = torch.zeros(batch, width, dtype=torch.long)
    leading = torch.ones(batch, width, dtype=torch.bool)
    for step in hits[:draft_tokens]:
        correct = torch.zeros(batch, width, dtype=torch.bool)
        correct[:, :step.shape[1]] = step.cpu()
        leading &= correct
        accepted += leading
    mask = loss_mask.bool().cpu()
    starts = mask[:, 1:-1] & mask[:, 2:]
    if max_new_tokens is not None:
        starts &= reply_offsets(mask)[:, 1:-1] < max_new_tokens - 1
    walks = []
    for row_accepted, row_starts in zip(accepted.tolist(), starts.tolist()):
        lengths, t = [], 0
        while t < width:
            if row_starts[t]:
                lengths.append(row_accepted[t] + 1)
                t += row_accepted[t] + 1
            else:
                t += 1
        walks.append(lengths)
    return walks


def reply_offsets(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] long: each loss token's index within its run of loss tokens (its reply); 0 elsewhere."""
    counts = mask.long().cumsum(dim=1)
    # the count at the last non-loss position before each token, carried forward
    before_run = torch.where(mask, torch.zeros_like(counts), counts).cummax(dim=1).values
    return torch.where(mask, counts - before_run - 1, torch.zeros_like(counts))


class MetricsWriter:
    """metrics.jsonl (always) and TensorBoard (when installed); writes only on the main process."""

    def __init__(self, output_dir: Path, is_main: bool = True):
        self.path = Path(output_dir) / METRICS_FILE
        self.is_main = is_main
        self.tensorboard = None
        if is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                get_logger().info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self.tensorboard = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop lines a crashed run wrote after the checkpoint it is resumed from."""
        if not self.is_main or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:  # a half-written last line of a killed run
                continue
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            prefix, step = record["kind"], record["step"]
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
                elif isinstance(value, list) and key.endswith("_per_step"):
                    for j, item in enumerate(value):
                        self.tensorboard.add_scalar(f"{prefix}/{key[:-9]}_{j}", item, step)
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


class MetricsWindow:
    """Training metrics since the last metrics line, kept as device tensors until written."""

    def __init__(self):
        self._reset()
        self.tokens_per_s = 0.0
        self.last_loss = float("nan")
        self.data_wait_share = 0.0

    def _reset(self):
        self.sums, self.loss, self.grad_norm, self.steps = None, 0.0, 0.0, 0
        self.tokens, self.lr, self.started = 0, 0.0, time.time()
        self.data_wait_s = 0.0  # time the loop waited for the DataLoader: high means raise --num-workers

    def add(self, out: dict[str, Any]) -> None:
        if out["sums"] is not None:  # (None: a rank that only ran a stand-in this step)
            self.sums = add_sums(self.sums, out["sums"])
        self.loss = self.loss + out["loss"]
        self.grad_norm = self.grad_norm + out["grad_norm"].float()
        self.tokens = self.tokens + out["tokens"]
        self.lr = out["lr"]
        self.steps += 1

    def postfix(self, epoch: int, epochs: int) -> str:
        if self.last_loss != self.last_loss:  # nothing flushed yet: metrics come every --log-interval steps
            return f"epoch {epoch}/{epochs}"
        return (f"epoch {epoch}/{epochs}, loss {self.last_loss:.4f}, {self.tokens_per_s:.0f} tok/s, "
                f"{self.data_wait_share:.0%} waiting for data")

    def flush(self, decay: float, reduce: Callable | None = None) -> dict[str, Any]:
        """The window's metrics line; `reduce(sums, loss, tokens)` sums them over the ranks first."""
        elapsed = max(time.time() - self.started, 1e-9)
        sums, loss, tokens = self.sums, self.loss, self.tokens
        if reduce is not None:
            sums, loss, tokens = reduce(sums, loss, tokens)
        summary = summarize(sums, decay)
        tokens = int(tokens)
        record = {
            "loss": float(loss) / max(self.steps, 1),
            "loss_per_step": summary["loss_per_step"],
            "acc_per_step": summary["acc_per_step"],
            "sim_accept_len": summary["sim_accept_len"],
            **{key: summary[key] for key in ("target_missing_mass",) if key in summary},
            "grad_norm": float(self.grad_norm) / max(self.steps, 1),
            "lr": self.lr,
            "tokens": tokens,
            "tokens_per_s": round(tokens / elapsed, 1),
            "data_wait_share": round(min(self.data_wait_s / elapsed, 1.0), 4),
        }
        self.tokens_per_s, self.last_loss = record["tokens_per_s"], record["loss"]
        self.data_wait_share = record["data_wait_share"]
        self._reset()
        return record
