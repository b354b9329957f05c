"""Training of the EAGLE-3 drafter (stage 04): data, the optimiser step, validation, checkpoints, metrics.

The output folder (RUN_DIR/checkpoints) holds
  step_000500/, epoch_1/   an SGLang-ready drafter (config.json + model.safetensors), training_state.pt
                           (optimizer, scheduler, step, RNG, data position) and trainer_state.json (a
                           small readable summary), each folder written under a temporary name and renamed
  latest, best             symlinks to one of those (copies of the drafter files where symlinks fail),
                           with latest.json / best.json naming the folder
  metrics.jsonl            one JSON object per line: {"kind": "train" | "eval", "step", "epoch", ...}
  val_split.json           ids of the samples held out for validation
  tensorboard/             when the tensorboard package is installed

Everything is deterministic from --seed: the validation split, the batch plan of each epoch, the
initialisation, and the RNG state saved with each checkpoint, so --resume continues a stopped run exactly.
Only the main process writes (`is_main`), and metrics travel as sums and counts so that a distributed run
can all-reduce them before dividing.
"""
from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from common.batching import pack_by_length
from common.formats.files import read_json, write_json_atomic, write_text_atomic
from common.model.kernels import FP8_ALIGN
from common.train.optimizer import make_optimizer, make_scheduler
from common.cli.stage import Progress, get_logger

TRAINING_STATE = "training_state.pt"
TRAINER_STATE_JSON = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"
VAL_SPLIT_FILE = "val_split.json"
LATEST, BEST = "latest", "best"
STATE_FORMAT = 1
# Samples sorted by length together: large enough for little padding, small enough that the batches
# change from epoch to epoch.
BUCKET_WINDOW = 1024
# Optimizer steps skipped in a row for a non-finite gradient before the run is declared diverged.
MAX_NONFINITE_IN_A_ROW = 20


# --- configuration ---------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    """How one optimizer step is computed (what train_step and the benchmark share)."""
    lr: float = 1e-4
    scheduler: str = "cosine"
    warmup_ratio: float = 0.02
    max_grad_norm: float = 0.5
    grad_accum: int = 1
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    noise_std: float = 0.0
    device: str = "cpu"
    dtype: str = "float32"  # the drafter's parameters and computation (bfloat16 on GPU)
    fp8: bool = False  # GEMMs on FP8 tensor cores (Eagle3Drafter.use_fp8); batches padded to FP8_ALIGN


def compute_dtype_for(device: str, dtype: str) -> str:
    """--dtype on GPU; float32 on CPU, where bf16 matmuls are slow (and float32 is exact, which the resume
    test compares).

    Training computes in the parameters' dtype rather than under torch.autocast: common.model.drafter is built
    that way (its compute dtype is fc.weight.dtype; embeddings, RoPE tables and hidden states are cast to
    it), and scripts/bench_train_step.py times exactly that configuration. bf16 parameters are paired with
    fp32 master weights and fp32 moments in the optimizer (DrafterAdamW), so the update has autocast's
    precision. evaluate() still takes an autocast dtype for inference callers with float32 weights.
    """
    return dtype if str(device).startswith("cuda") else "float32"


def amp_dtype_for(device: str, dtype: str) -> str | None:
    """For inference-only callers that keep float32 weights (stage 05 --mode eval): the autocast dtype on
    GPU, None on CPU. Training does not autocast (see compute_dtype_for)."""
    return None if compute_dtype_for(device, dtype) == "float32" else dtype


# --- data ------------------------------------------------------------------------------------------

def split_train_val(ids: Sequence[str], val_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    """Positions of training and validation samples: a seeded shuffle of the ids, decided per sample.

    The order of the index file does not matter (ids are sorted first), so re-running stage 02 in another
    order gives the same split.
    """
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    rng = np.random.default_rng([seed, 0x5A17])
    shuffled = [order[i] for i in rng.permutation(len(order))]
    n_val = int(round(val_ratio * len(ids)))
    if val_ratio > 0 and n_val == 0 and len(ids) > 1:
        n_val = 1
    n_val = min(n_val, max(len(ids) - 1, 0))
    return sorted(shuffled[n_val:]), sorted(shuffled[:n_val])


def plan_batches(lengths: Sequence[int], max_tokens: int, max_sequences: int, seed: int, epoch: int,
                 shuffle: bool = True) -> list[list[int]]:
    """The batches of one epoch as lists of positions into `lengths`, deterministic from (seed, epoch).

    Samples are shuffled, sorted by length inside windows of BUCKET_WINDOW (similar lengths share a batch,
    so little padding), packed to at most `max_tokens` padded tokens and `max_sequences` sequences, and
    the batches shuffled. Without `shuffle` (validation) the whole set is sorted once.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    window = BUCKET_WINDOW if shuffle else max(len(lengths), 1)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        batches.extend(pack_by_length(chunk.tolist(), lengths, max_tokens, max_sequences))
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def steps_in_epoch(num_batches: int, grad_accum: int) -> int:
    return math.ceil(num_batches / grad_accum)


def step_shares(num_batches: int, start: int, micro_per_step: int, world_size: int = 1,
                rank: int = 0) -> list[tuple[int, list[tuple[int, float]]]]:
    """One rank's part of each optimizer step of an epoch plan, from plan position `start` on.

    A step takes the plan's next `micro_per_step` micro-batches (grad-accum x ranks; fewer at the epoch's
    end), whatever the number of ranks, so 2 ranks with --grad-accum 1 train on exactly the batches of one
    process with --grad-accum 2. Rank r takes every world_size-th of them from the r-th, each weighted by
    its share 1/n of the step's mean loss; a rank left without one (a short last step) gets a stand-in, a
    batch of that step with weight 0, so that it still takes part in the gradient reduction.
    Returns [(plan position after the step, [(plan position, weight), ...]), ...].
    """
    steps = []
    for begin in range(start, num_batches, micro_per_step):
        end = min(begin + micro_per_step, num_batches)
        share = [(index, 1.0 / (end - begin)) for index in range(begin + rank, end, world_size)]
        steps.append((end, share or [(end - 1, 0.0)]))
    return steps


class HiddenStateDataset(Dataset):
    """One stage-02 sample per item, read through common.extract.extraction and cut to max_seq_len."""

    def __init__(self, data_dir: str | Path, entries: Sequence[dict], max_seq_len: int):
        self.data_dir = str(data_dir)
        self.entries = list(entries)
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.entries)

    def lengths(self) -> list[int]:
        return [min(int(entry["num_tokens"]), self.max_seq_len) for entry in self.entries]

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        from common.extract.extraction import load_sample

        sample = load_sample(self.data_dir, self.entries[position])
        return {key: sample[key][: self.max_seq_len] for key in ("input_ids", "loss_mask", "aux", "final")}


def collate(samples: Sequence[dict[str, torch.Tensor]], pad_to: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into the batch ttt_loss takes; attention_mask is 1 on real tokens.
    The length is rounded up to a multiple of `pad_to` (FP8 GEMMs need multiples of 16)."""
    longest = max(int(s["input_ids"].shape[0]) for s in samples)
    longest = -(-longest // pad_to) * pad_to
    count = len(samples)
    first = samples[0]
    batch = {
        "input_ids": torch.zeros(count, longest, dtype=torch.long),
        "loss_mask": torch.zeros(count, longest, dtype=torch.long),
        "attention_mask": torch.zeros(count, longest, dtype=torch.long),
        # Kept in the stored dtype (bf16): the cast to float32 happens on the device, halving transfers.
        "aux": torch.zeros(count, longest, first["aux"].shape[-1], dtype=first["aux"].dtype),
        "final": torch.zeros(count, longest, first["final"].shape[-1], dtype=first["final"].dtype),
    }
    for row, sample in enumerate(samples):
        length = int(sample["input_ids"].shape[0])
        batch["input_ids"][row, :length] = sample["input_ids"]
        batch["loss_mask"][row, :length] = sample["loss_mask"].to(torch.long)
        batch["attention_mask"][row, :length] = 1
        batch["aux"][row, :length] = sample["aux"]
        batch["final"][row, :length] = sample["final"]
    return batch


def make_loader(dataset: Dataset, batches: Sequence[list[int]], num_workers: int, device: str,
                seed: int, pad_to: int = 1) -> DataLoader:
    """A DataLoader over a fixed batch plan. Its own generator keeps it from drawing on the global RNG,
    which would otherwise make a resumed run's noise differ from an uninterrupted one."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_sampler=list(batches), collate_fn=functools.partial(collate, pad_to=pad_to),
                      num_workers=num_workers,
                      pin_memory=str(device).startswith("cuda"), generator=generator,
                      prefetch_factor=4 if num_workers > 0 else None)


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Move a batch to the device, hidden states in their stored dtype (the drafter casts them itself)."""
    non_blocking = torch.device(device).type == "cuda"
    return {key: value.to(device, non_blocking=non_blocking) for key, value in batch.items()}


# --- optimisation ------------------------------------------------------------------------------------

def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Parameters to `dtype`, buffers untouched: model.to(bf16) would also round the float32 RoPE
    frequencies (inv_freq), which SGLang computes in float32."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the drafter computes: its trainable weights' device (the frozen embedding may be offloaded to
    the CPU, and it is the first parameter)."""
    return next(p for p in model.parameters() if p.requires_grad).device


def _add_sums(total: dict[str, torch.Tensor] | None, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts = {key: metrics[key].detach().double() for key in ("loss_sum", "correct", "count")}
    if total is None:
        return parts
    return {key: total[key] + parts[key] for key in parts}


def train_step(model: torch.nn.Module, batch: dict | Sequence[dict], optimizer: torch.optim.Optimizer,
               scheduler, verifier_lm_head: torch.Tensor, cfg: TrainConfig, parallel=None,
               weights: Sequence[float] | None = None) -> dict[str, Any]:
    """One optimizer step over one batch or a list of micro-batches (gradient accumulation).

    Returns "loss" (mean over micro-batches of the TTT loss), "grad_norm" (before clipping), "sums" (per
    TTT step loss_sum/correct/count), "tokens" (real tokens) as device tensors, "lr" (the rate this step
    used) and "finite". The finite-gradient check is the step's one device sync: a non-finite gradient
    skips the update (the step still counts, so the schedule stays aligned).

    On several ranks (`parallel`: common.train.data_parallel), `batch` is this rank's part of the step and
    `weights[i]` each micro-batch's share of the step's mean loss over all ranks (0 for a stand-in that only
    takes part in the gradient reduction); "loss", "sums" and "tokens" are then this rank's parts, to be
    summed over the ranks, and "grad_norm" and "finite" are global.
    """
    from common.train.loss import ttt_loss

    micro_batches = [batch] if isinstance(batch, dict) else list(batch)
    device = model_device(model)
    model.train()
    if hasattr(model, "gemms"):
        model.gemms.new_step()  # the weights changed in the last optimizer step
    lr = optimizer.param_groups[0]["lr"]
    total_loss = torch.zeros((), device=device)
    sums, tokens = None, torch.zeros((), device=device, dtype=torch.long)
    for index, micro in enumerate(micro_batches):
        micro = to_device(micro, device)
        if parallel is None:
            loss, metrics = ttt_loss(model, micro, verifier_lm_head, cfg.ttt_steps, decay=cfg.ttt_decay,
                                     noise_std=cfg.noise_std)
            (loss / len(micro_batches)).backward()
            total_loss += loss.detach().float() / len(micro_batches)
        else:
            weight = weights[index]
            last = index == len(micro_batches) - 1  # the backward that reduces the gradients over the ranks
            with nullcontext() if last else parallel.no_sync():
                loss, metrics = parallel.module(micro, verifier_lm_head, cfg.ttt_steps, cfg.ttt_decay, cfg.noise_std)
                # DDP and FSDP average over the ranks: scaled so, the result is the step's mean gradient
                (loss * (weight * parallel.world_size)).backward()
            if weight == 0:
                continue
            total_loss += loss.detach().float() * weight
        sums = _add_sums(sums, metrics)
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


# --- evaluation ------------------------------------------------------------------------------------

def summarize(sums: dict[str, torch.Tensor] | None, decay: float) -> dict[str, Any]:
    """Per-step loss and top-1 agreement, the decay-weighted loss, and the simulated acceptance length."""
    from common.train.loss import simulated_acceptance_length

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
    }


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
             reduce: Callable[[dict], dict] | None = None, amp_dtype: str | None = None) -> dict[str, Any]:
    """Validation metrics of a drafter: per-TTT-step loss and top-1 agreement with the verifier, the
    weighted loss, and the simulated acceptance length 1 + sum_k prod_{j<=k} acc_j.

    `loader_or_samples`: a DataLoader (or any iterable) of collated batches, or of single samples as
    load_sample returns them. `reduce` all-reduces the sums in a distributed run (it gets None from a rank
    without batches). `amp_dtype` runs the forward under torch.autocast, for callers that keep float32
    weights (no backward here, so the drafter's fused functions are fine with it); stage 04 validates in
    the parameters' own dtype instead. Used by stage 04's validation and stage 05's --mode eval.
    """
    from common.train.loss import ttt_loss

    device = torch.device(device) if device is not None else model_device(model)
    was_training = model.training
    model.eval()
    sums = None
    try:
        for batch in _as_batches(loader_or_samples):
            batch = to_device(batch, device)
            with _autocast(device, amp_dtype):
                _, metrics = ttt_loss(model, batch, verifier_lm_head, ttt_steps, decay=decay, noise_std=0.0)
            sums = _add_sums(sums, metrics)
    finally:
        model.train(was_training)
    if reduce is not None:  # (also on a rank that had no batch: the collective needs every rank)
        sums = reduce(sums)
    return summarize(sums, decay)


# --- RNG state ---------------------------------------------------------------------------------------

def capture_rng_state() -> dict[str, Any]:
    """Every RNG the training draws on, in a form torch.load(weights_only=True) reads back."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            get_logger().warning("checkpoint has CUDA RNG states for %d GPUs, %d visible: CUDA RNG not "
                                 "restored (noise draws will differ from the original run)",
                                 len(state["cuda"]), torch.cuda.device_count())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# --- metrics -----------------------------------------------------------------------------------------

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


# --- checkpoints -------------------------------------------------------------------------------------

def checkpoint_name(step: int, epoch_end: int | None = None) -> str:
    return f"epoch_{epoch_end}" if epoch_end is not None else f"step_{step:06d}"


class CheckpointManager:
    """Writes checkpoint folders atomically, keeps the latest/best pointers, prunes old step folders."""

    def __init__(self, root: str | Path, keep_last: int, is_main: bool = True,
                 validate: Callable[[Path], list[str]] | None = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_main = is_main
        self.validate = validate

    # writing
    def save(self, name: str, model: torch.nn.Module, training_state: dict[str, Any],
             summary: dict[str, Any]) -> Path:
        """root/name with the drafter, training_state.pt and trainer_state.json, renamed into place only
        when complete; then checked (check_drafter_dir) and pointed to by `latest`."""
        from common.formats.checkpoint import save_drafter

        final = self.root / name
        if not self.is_main:
            return final
        staging = self.root / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        save_drafter(model, staging, extra={"training": {k: summary.get(k) for k in
                                                        ("checkpoint", "step", "epoch", "val_sim_accept_len")}})
        torch.save(training_state, staging / TRAINING_STATE)
        write_json_atomic(staging / TRAINER_STATE_JSON, summary)
        self._replace_dir(staging, final)
        if self.validate is not None:
            problems = self.validate(final)
            if problems:
                raise RuntimeError(f"checkpoint {final} fails check_drafter_dir:\n  " + "\n  ".join(problems))
        self.point(LATEST, name, summary)
        return final

    def _replace_dir(self, staging: Path, final: Path) -> None:
        # A folder of the same name exists when a resumed run redoes a step that a crashed run saved
        # after its last `latest` update: the new one replaces it.
        if final.exists() or final.is_symlink():
            trash = self.root / f".{final.name}.old-{os.getpid()}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(staging, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, final)

    def point(self, pointer: str, name: str, summary: dict[str, Any]) -> None:
        """`pointer` -> root/name as a relative symlink (swapped atomically), or a copy of the drafter files
        where the filesystem has no symlinks; pointer.json names the target either way."""
        if not self.is_main:
            return
        link = self.root / pointer
        tmp_link = self.root / f".{pointer}.tmp-{os.getpid()}"
        try:
            if tmp_link.is_symlink() or tmp_link.exists():
                tmp_link.unlink()
            os.symlink(name, tmp_link, target_is_directory=True)
            if link.is_dir() and not link.is_symlink():
                shutil.rmtree(link)
            os.replace(tmp_link, link)
        except OSError:
            self._copy_pointer(link, self.root / name)
        write_json_atomic(self.root / f"{pointer}.json", {"checkpoint": name, **summary})

    def _copy_pointer(self, link: Path, target: Path) -> None:
        staging = self.root / f".{link.name}.copy-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for item in target.iterdir():
            if item.is_file() and item.name != TRAINING_STATE:
                shutil.copy2(item, staging / item.name)
        if link.is_symlink():
            link.unlink()
        self._replace_dir(staging, link)

    def prune(self) -> list[str]:
        """Delete step folders beyond the newest keep_last, never a target of latest or best."""
        if not self.is_main:
            return []
        protected = {self.pointer_target(LATEST), self.pointer_target(BEST)}
        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir() and not p.is_symlink()),
                       key=lambda p: int(p.name.split("_")[1]))
        removed = []
        for path in steps[: max(len(steps) - self.keep_last, 0)]:
            if path.name not in protected:
                shutil.rmtree(path)
                removed.append(path.name)
        return removed

    # reading
    def pointer_target(self, pointer: str) -> str | None:
        path = self.root / f"{pointer}.json"
        if not path.exists():
            return None
        try:
            return read_json(path).get("checkpoint")
        except json.JSONDecodeError:
            return None

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every finished checkpoint, oldest first."""
        found = []
        for path in list(self.root.glob("step_*")) + list(self.root.glob("epoch_*")):
            summary = path / TRAINER_STATE_JSON
            if path.is_dir() and not path.is_symlink() and summary.exists() and (path / TRAINING_STATE).exists():
                try:
                    found.append((int(read_json(summary)["step"]), path))
                except (json.JSONDecodeError, KeyError, ValueError):
                    continue
        return sorted(found, key=lambda item: (item[0], item[1].name.startswith("epoch")))

    def resume_point(self) -> Path | None:
        """The newest complete checkpoint (the `latest` pointer may lag one that was renamed into place
        just before a crash)."""
        found = self.complete_checkpoints()
        return found[-1][1] if found else None

    def has_outputs(self) -> bool:
        names = ("step_*", "epoch_*", LATEST, BEST, f"{LATEST}.json", f"{BEST}.json", METRICS_FILE)
        return any(any(self.root.glob(pattern)) for pattern in names)

    def clear(self) -> None:
        """--overwrite: remove what a previous run of this stage wrote here (and nothing else)."""
        for pattern in ("step_*", "epoch_*", ".step_*", ".epoch_*", f".{LATEST}*", f".{BEST}*", LATEST, BEST,
                        f"{LATEST}.json", f"{BEST}.json", METRICS_FILE, VAL_SPLIT_FILE, "tensorboard"):
            for path in self.root.glob(pattern):
                if path.is_symlink() or path.is_file():
                    path.unlink()
                else:
                    shutil.rmtree(path)


# --- the training loop -------------------------------------------------------------------------------

@dataclass
class LoopConfig:
    """The schedule of the loop around train_step."""
    epochs: int
    max_tokens: int
    max_sequences: int
    num_workers: int = 0
    seed: int = 0
    eval_interval: int = 500
    save_interval: int = 2000
    log_interval: int = 10


@dataclass
class LoopState:
    step: int = 0              # optimizer steps done
    epoch: int = 0             # epoch in progress (0-based)
    batches_consumed: int = 0  # micro-batches of that epoch already trained on
    best_value: float | None = None
    best_checkpoint: str | None = None
    nonfinite_in_a_row: int = 0


class StopRequests:
    """SIGINT or SIGTERM during training (Ctrl-C, `kill`, a scheduler's preemption, `timeout -s INT`): the step
    in progress finishes, a checkpoint of it is saved and the run stops, to continue from exactly there with
    --resume. A second signal stops at once, from the last checkpoint. (Signal handlers can only be set from
    the main thread; elsewhere the default behaviour stays.)"""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        get_logger().warning("%s received: stopping after this step, with a checkpoint (again to stop at once)",
                             signal.Signals(signum).name)


SIGNAL_ENV = "EAGLE3_TEST_SIGNAL_AFTER_STEP"


def signal_hooks_for_tests(rank: int) -> list[Callable[["Trainer"], None]]:
    """EAGLE3_TEST_SIGNAL_AFTER_STEP=STEP:RANK (tests only): that rank sends itself SIGTERM after that optimizer
    step, as a scheduler signalling one process of a distributed job would."""
    wanted = os.environ.get(SIGNAL_ENV)
    if not wanted:
        return []
    step, signalled_rank = (int(part) for part in wanted.split(":"))
    if rank != signalled_rank:
        return []

    def hook(trainer: "Trainer") -> None:
        if trainer.state.step == step:
            signal.raise_signal(signal.SIGTERM)
    return [hook]


class Trainer:
    """The loop of stage 04: epochs of bucketed batches, train_step, periodic validation and checkpoints.

    `hooks` are called as hook(trainer) after every optimizer step (after any checkpoint of that step);
    an exception there stops the run as a crash would.

    `parallel` (common.train.data_parallel, under torchrun): the model is wrapped in DDP or FSDP here, each rank
    trains on its part of every step (step_shares) and validates on every world_size-th validation batch,
    metrics are summed over the ranks before they are divided, and checkpoints (written by rank 0) hold
    the single-process state with the global data position, so a run resumes on any number of ranks.
    """

    def __init__(self, model: torch.nn.Module, verifier_lm_head: torch.Tensor, cfg: TrainConfig,
                 loop: LoopConfig, train_set: HiddenStateDataset, val_set: HiddenStateDataset | None,
                 output_dir: str | Path, keep_last: int, run_config: dict[str, Any],
                 validate_checkpoint: Callable[[Path], list[str]] | None = None, is_main: bool = True,
                 hooks: Sequence[Callable[["Trainer"], None]] = (), parallel=None):
        self.model, self.verifier_lm_head, self.cfg, self.loop = model, verifier_lm_head, cfg, loop
        self.train_set, self.val_set = train_set, val_set
        self.output_dir = Path(output_dir)
        self.run_config = run_config
        self.is_main = is_main
        self.hooks = list(hooks)
        self.log = get_logger()
        self.parallel = parallel
        self.world_size = parallel.world_size if parallel is not None else 1
        self.rank = parallel.info.rank if parallel is not None else 0
        if parallel is not None:
            parallel.wrap(model)
        self.micro_per_step = cfg.grad_accum * self.world_size
        self.train_lengths = train_set.lengths()
        self.epoch_plans = [plan_batches(self.train_lengths, loop.max_tokens, loop.max_sequences, loop.seed, e)
                            for e in range(loop.epochs)]
        self.total_steps = sum(steps_in_epoch(len(plan), self.micro_per_step) for plan in self.epoch_plans)
        self.val_batches = (plan_batches(val_set.lengths(), loop.max_tokens, loop.max_sequences, loop.seed, 0,
                                         shuffle=False) if val_set is not None and len(val_set) else [])
        self.optimizer = make_optimizer(model, cfg.lr) if parallel is None else parallel.make_optimizer(cfg.lr)
        self.scheduler = make_scheduler(self.optimizer, self.total_steps, cfg.warmup_ratio, cfg.scheduler)
        self.state = LoopState()
        self.checkpoints = CheckpointManager(self.output_dir, keep_last, is_main, validate_checkpoint)
        self.metrics = MetricsWriter(self.output_dir, is_main)
        self.last_eval: dict[str, Any] | None = None

    # --- state ----------------------------------------------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "loop_state": asdict(self.state),
            "optimizer": (self.optimizer.state_dict() if self.parallel is None
                          else self.parallel.optimizer_state(self.optimizer)),  # whole tensors, also under FSDP
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(),
            "run_config": self.run_config,
        }

    def load_training_state(self, folder: Path) -> None:
        state = torch.load(folder / TRAINING_STATE, map_location="cpu", weights_only=True)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{folder / TRAINING_STATE}: unknown format {state.get('format')!r}")
        if self.parallel is None:
            load_weights_exactly(self.model, folder)
            load_optimizer_state(self.optimizer, state["optimizer"])
        else:
            self.parallel.load_weights(folder)
            self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.state = LoopState(**state["loop_state"])
        restore_rng_state(state["rng"])
        self.metrics.truncate_after(self.state.step)

    def summary(self, **extra) -> dict[str, Any]:
        """What trainer_state.json, latest.json and best.json say about the current state."""
        return {"step": self.state.step, "epoch": self.state.epoch, "batches_consumed": self.state.batches_consumed,
                "total_steps": self.total_steps, "world_size": self.world_size, **extra}

    # --- the loop -------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        loop, cfg, state = self.loop, self.cfg, self.state
        if state.epoch >= loop.epochs:
            self.log.info("training already finished at step %d (%d epochs)", state.step, loop.epochs)
            return self.summary(best=state.best_checkpoint)
        self.log.info("training: %d samples, %d validation; %d optimizer steps over %d epochs "
                      "(%d micro-batches of at most %d padded tokens and %s sequences, %d a step: grad-accum %d "
                      "x %d rank(s))", len(self.train_set), len(self.val_set or []), self.total_steps, loop.epochs,
                      sum(len(p) for p in self.epoch_plans), loop.max_tokens,
                      loop.max_sequences if loop.max_sequences < (1 << 30) else "any number of",
                      self.micro_per_step, cfg.grad_accum, self.world_size)
        window = _Window()
        with Progress(self.total_steps, "04_train", unit="step", initial=state.step) as progress, \
                StopRequests() as stop:
            for epoch in range(state.epoch, loop.epochs):
                plan = self.epoch_plans[epoch]
                start = state.batches_consumed if epoch == state.epoch else 0
                state.epoch, state.batches_consumed = epoch, start
                steps = step_shares(len(plan), start, self.micro_per_step, self.world_size, self.rank)
                loader = make_loader(self.train_set, [plan[i] for _, share in steps for i, _ in share],
                                     loop.num_workers, cfg.device, loop.seed * 1000 + epoch,
                                     pad_to=FP8_ALIGN if cfg.fp8 else 1)
                batches = iter(loader)
                for end, share in steps:
                    waited = time.time()
                    group = [next(batches) for _ in share]
                    window.data_wait_s += time.time() - waited
                    if self.parallel is not None and cfg.noise_std > 0:
                        # each rank its own noise, drawn alike when a run with the same ranks is resumed
                        torch.manual_seed((loop.seed * 1_000_003 + state.step) * 1_009 + self.rank)
                    out = train_step(self.model, group, self.optimizer, self.scheduler, self.verifier_lm_head, cfg,
                                     parallel=self.parallel, weights=[weight for _, weight in share])
                    self._check_finite(out)
                    state.step += 1
                    state.batches_consumed = end  # global: the plan position, whatever the number of ranks
                    window.add(out)
                    epoch_end = end == len(plan)
                    if epoch_end:  # a checkpoint taken now resumes at the start of the next epoch
                        state.epoch, state.batches_consumed = epoch + 1, 0
                    saved = self._after_step(window, progress, epoch + 1, epoch_end)
                    for hook in self.hooks:
                        hook(self)
                    if self._stop_requested(stop):
                        self._stop_here(window, epoch + 1, saved)
        self.metrics.close()
        return self.summary(best=state.best_checkpoint, best_value=state.best_value, last_eval=self.last_eval)

    def _check_finite(self, out: dict[str, Any]) -> None:
        if out["finite"]:
            self.state.nonfinite_in_a_row = 0
            return
        self.state.nonfinite_in_a_row += 1
        self.log.warning("step %d: non-finite gradient norm; update skipped", self.state.step + 1)
        if self.state.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
            raise RuntimeError(f"training diverged: {MAX_NONFINITE_IN_A_ROW} non-finite gradients in a row at "
                               f"step {self.state.step + 1}; lower --lr or --max-grad-norm, or check the data")

    def _after_step(self, window: "_Window", progress: Progress, epoch: int, epoch_end: bool) -> str | None:
        """Progress, then (when due) a training-metrics line, validation, and a checkpoint, whose name it
        returns (None when none was due). `epoch` is 1-based."""
        loop, step = self.loop, self.state.step
        progress.update(1, window.postfix(epoch, loop.epochs))
        save_due = step % loop.save_interval == 0 or epoch_end
        # The window is also closed at every checkpoint, so that a run resumed from it writes the very
        # lines the uninterrupted run wrote.
        if step % loop.log_interval == 0 or save_due:
            self._write_train_line(window, epoch)
        evaluated = None
        if step % loop.eval_interval == 0 or epoch_end:
            evaluated = self.validate(epoch)
        if not save_due:
            return None
        name = checkpoint_name(step, epoch if epoch_end else None)
        self.save(name, evaluated, epoch_end)
        return name

    def _write_train_line(self, window: "_Window", epoch: int) -> None:
        reduce = self._reduce_window if self.parallel is not None else None
        self.metrics.write({"kind": "train", "step": self.state.step, "epoch": epoch,
                            **window.flush(self.cfg.ttt_decay, reduce)})

    def _stop_requested(self, stop: StopRequests) -> bool:
        if self.parallel is None:
            return stop.received is not None
        # Every rank must stop after the same step (the next one would wait for the others' gradients): a signal
        # seen by any rank stops them all. One tiny reduction a step.
        flag = torch.tensor([float(stop.received is not None)], dtype=torch.float64, device=model_device(self.model))
        return bool(self.parallel.reduce_sums({"stop": flag})["stop"].item() > 0)

    def _stop_here(self, window: "_Window", epoch: int, saved: str | None) -> None:
        """Save the step just finished (unless that step saved already) and stop the run."""
        step = self.state.step
        if saved is None:
            if window.steps:  # the steps since the last metrics line
                self._write_train_line(window, epoch)
            saved = checkpoint_name(step, None)
            self.save(saved, None, False)
        self.log.warning("stopped after step %d of %d, saved as %s: rerun the same command with --resume to "
                         "continue from there", step, self.total_steps, saved)
        raise KeyboardInterrupt

    def validate(self, epoch: int) -> dict[str, Any] | None:
        if not self.val_batches:
            return None
        mine = self.val_batches[self.rank::self.world_size]
        loader = make_loader(self.val_set, mine, self.loop.num_workers, self.cfg.device, self.loop.seed)
        started = time.time()
        with self.parallel.full_parameters() if self.parallel is not None else nullcontext():
            result = evaluate(self.model, loader, self.verifier_lm_head, self.cfg.ttt_steps, decay=self.cfg.ttt_decay,
                              reduce=self._reduce_sums if self.parallel is not None else None)
        result = {"kind": "eval", "step": self.state.step, "epoch": epoch, **result,
                  "seconds": round(time.time() - started, 3)}
        self.metrics.write(result)
        self.last_eval = result
        self.log.info("validation at step %d: loss %.4f, top-1 agreement per TTT step %s, simulated acceptance "
                      "length %.3f (%d tokens)", self.state.step, result["loss"],
                      [round(a, 3) for a in result["acc_per_step"]], result["sim_accept_len"], result["tokens"])
        return result

    # --- sums over the ranks --------------------------------------------------------------------------
    def _zero_sums(self) -> dict[str, torch.Tensor]:
        device = model_device(self.model)
        return {key: torch.zeros(self.cfg.ttt_steps, dtype=torch.float64, device=device)
                for key in ("loss_sum", "correct", "count")}

    def _reduce_sums(self, sums: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        return self.parallel.reduce_sums(sums if sums is not None else self._zero_sums())

    def _reduce_window(self, sums, loss, tokens):
        """A metrics window's (sums, loss, tokens) summed over the ranks (train_step gives each rank's part)."""
        device = model_device(self.model)
        parts = dict(sums if sums is not None else self._zero_sums())
        parts["loss"] = torch.as_tensor(loss, dtype=torch.float64, device=device)
        parts["tokens"] = torch.as_tensor(tokens, dtype=torch.float64, device=device)
        out = self.parallel.reduce_sums(parts)
        return {key: out[key] for key in ("loss_sum", "correct", "count")}, out["loss"], out["tokens"]

    def _update_best(self, name: str, evaluated: dict[str, Any] | None, epoch_end: bool) -> str | None:
        """The reason `name` becomes `best`, or None. Best is the highest validation simulated acceptance
        length; with no validation split, the latest epoch; until anything is measured, the latest save
        (so that `best`, stage 05's default, always resolves)."""
        state = self.state
        if evaluated is not None:
            if state.best_value is None or evaluated["sim_accept_len"] > state.best_value:
                state.best_value, state.best_checkpoint = evaluated["sim_accept_len"], name
                return "val_sim_accept_len"
            return None
        if not self.val_batches and epoch_end:
            state.best_checkpoint = name
            return "latest epoch (no validation split)"
        if state.best_checkpoint is None:
            return "latest (nothing validated yet)"
        return None

    def save(self, name: str, evaluated: dict[str, Any] | None, epoch_end: bool) -> None:
        reason = self._update_best(name, evaluated, epoch_end)
        summary = self.summary(checkpoint=name,
                               val_sim_accept_len=evaluated["sim_accept_len"] if evaluated else None,
                               val_acc_per_step=evaluated["acc_per_step"] if evaluated else None,
                               run_config=self.run_config)
        # (under FSDP both gather whole tensors: every rank takes part, rank 0 writes)
        model = self.model if self.parallel is None else self.parallel.export_model()
        path = self.checkpoints.save(name, model, self.training_state(), summary)
        if reason is not None:
            self.checkpoints.point(BEST, name, {**summary, "metric": reason})
        removed = self.checkpoints.prune()
        self.log.info("saved checkpoint %s%s%s", path, f" (best: {reason})" if reason else "",
                      f"; pruned {', '.join(removed)}" if removed else "")


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """optimizer.load_state_dict, then the saved dtypes back: torch casts every floating state tensor to its
    parameter's dtype on load, which would turn the fp32 moments and master weights of bf16 parameters into
    bf16 (a resumed run would then drift from the original)."""
    optimizer.load_state_dict(saved)
    saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param_id, param in zip(saved_ids, params):
        for key, value in saved["state"].get(param_id, {}).items():
            current = optimizer.state[param].get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and current.dtype != value.dtype:
                optimizer.state[param][key] = value.to(device=current.device)


def load_weights_exactly(model: torch.nn.Module, folder: Path) -> None:
    """Put a checkpoint's exported tensors back into `model`, refusing any dtype change (which would make a
    resumed run differ from the run it continues). The exported file holds every trainable tensor in the
    parameters' own dtype, and fp32 master weights (for bf16 runs) live in the optimizer state."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in tensors]
    if missing:
        raise ValueError(f"{folder}/model.safetensors lacks trainable tensors {missing}")
    with torch.no_grad():
        for name, value in tensors.items():
            if name not in own:
                continue
            if own[name].dtype != value.dtype:
                raise ValueError(f"{folder}/model.safetensors holds {name} as {value.dtype} but this run's drafter "
                                 f"is {own[name].dtype}; resume with the original --dtype")
            own[name].copy_(value)


class _Window:
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
            self.sums = _add_sums(self.sums, out["sums"])
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
