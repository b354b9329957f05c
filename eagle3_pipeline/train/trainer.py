"""The training loop of stage 04 (Trainer): epochs of planned batches, train_step, periodic validation,
checkpoints and metrics, stopping and resuming (see docs/training.md)."""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from eagle3_pipeline.errors import StageFailure
from eagle3_pipeline.progress import Progress
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.figures import figures_text
from eagle3_pipeline.train.checkpoints import (BEST, TRAINING_STATE, CheckpointManager, capture_rng_state,
    checkpoint_bytes, checkpoint_name, load_optimizer_state, load_weights_exactly, restore_rng_state)
from eagle3_pipeline.train.data import (HiddenStateDataset, StoredStates, collate, make_loader, plan_batches,
    read_batches, step_shares, steps_in_epoch)
from eagle3_pipeline.train.metrics import MetricsWindow, MetricsWriter
from eagle3_pipeline.train.parameters import model_device
from eagle3_pipeline.train.step import TrainConfig, evaluate, train_step
from eagle3_pipeline.train.stopping import StopRequests
from eagle3_pipeline.train.optimizer import make_optimizer, make_scheduler

STATE_FORMAT = 1
# Optimizer steps skipped in a row for a non-finite gradient before the run is declared diverged.
MAX_NONFINITE_IN_A_ROW = 20


@dataclass
class LoopConfig:
    """The schedule of the loop around train_step."""
    epochs: int
    max_tokens: int
    max_sequences: int
    pad_to: int = 1            # batch lengths rounded up to a multiple of this (eagle3_pipeline.train.data)
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


def states_finite(batch: dict[str, torch.Tensor], row: int) -> bool:
    """Whether one row of a batch has only finite hidden states (stored or computed) and targets."""
    return all(bool(torch.isfinite(batch[key][row].float()).all())
               for key in ("aux", "final", "aux_scale", "topk_logprobs") if key in batch)


class Trainer:
    """The loop of stage 04: epochs of bucketed batches, train_step, periodic validation and checkpoints.

    `hooks` are called as hook(trainer) after every optimizer step (after any checkpoint of that step);
    an exception there stops the run as a crash would.

    `parallel` (eagle3_pipeline.train.data_parallel, under torchrun): the model is wrapped in DDP or FSDP here, each
    rank trains on its part of every step (step_shares) and validates on every world_size-th validation batch,
    metrics are summed over the ranks before they are divided, and checkpoints (written by rank 0) hold
    the single-process state with the global data position, so a run resumes on any number of ranks.
    """

    def __init__(self, model: torch.nn.Module, verifier_lm_head: torch.Tensor, cfg: TrainConfig,
                 loop: LoopConfig, train_set: HiddenStateDataset, val_set: HiddenStateDataset | None,
                 output_dir: str | Path, keep_last: int, run_config: dict[str, Any],
                 validate_checkpoint: Callable[[Path], list[str]] | None = None, is_main: bool = True,
                 hooks: Sequence[Callable[["Trainer"], None]] = (), parallel=None, source=None):
        self.model, self.verifier_lm_head, self.cfg, self.loop = model, verifier_lm_head, cfg, loop
        self.source = source or StoredStates()  # stage 02's files, or the verifier's states (--online)
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
        self.epoch_plans = [plan_batches(self.train_lengths, loop.max_tokens, loop.max_sequences, loop.seed, e,
                                         pad_to=loop.pad_to) for e in range(loop.epochs)]
        self.total_steps = sum(steps_in_epoch(len(plan), self.micro_per_step) for plan in self.epoch_plans)
        self.val_batches = (plan_batches(val_set.lengths(), loop.max_tokens, loop.max_sequences, loop.seed, 0,
                                         shuffle=False, pad_to=loop.pad_to)
                            if val_set is not None and len(val_set) else [])
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
        """Put back the state saved in `folder` (CheckpointManager.resume_point has checked its files). What still
        fails to load stops the run with the folder named, not a traceback."""
        try:
            self._load_training_state(folder)
        except ValueError as err:  # a setting that does not fit the checkpoint: the message says which
            raise StageFailure(f"--resume from {folder}: {err}") from None
        except Exception as err:  # noqa: BLE001 - a file that reads wrong: named with the way on
            raise StageFailure(f"--resume from {folder}: cannot load it ({type(err).__name__}: {str(err)[:300]}). "
                               f"Move the folder out of {self.output_dir} to resume from the newest checkpoint "
                               f"before it, or start over with --overwrite") from None

    def _load_training_state(self, folder: Path) -> None:
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

    def checkpoint_bytes(self) -> int:
        """About the bytes a checkpoint of the current state takes (for the message of a full disk; this rank's
        optimizer state, without the gathering that training_state does under FSDP)."""
        return checkpoint_bytes(self.model, {"optimizer": self.optimizer.state_dict()})

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
        window = MetricsWindow()
        with Progress(self.total_steps, "04_train", unit="step", initial=state.step) as progress, \
                StopRequests() as stop:
            for epoch in range(state.epoch, loop.epochs):
                plan = self.epoch_plans[epoch]
                start = state.batches_consumed if epoch == state.epoch else 0
                state.epoch, state.batches_consumed = epoch, start
                # from the start of the source's pass that holds `start` (its batches are made ready together)
                chunk = self.micro_per_step * self.source.steps_per_pass
                steps = step_shares(len(plan), start - start % chunk, self.micro_per_step, self.world_size, self.rank)
                reading = [plan[i] for _, share in steps for i, _ in share]
                loader = make_loader(self.train_set, reading, loop.num_workers, cfg.device, loop.seed * 1000 + epoch,
                                     pad_to=loop.pad_to)
                ready = self.source.step_batches(read_batches(loader), steps, (start % chunk) // self.micro_per_step,
                                                 cfg.device)
                for end, share, group, waited in ready:
                    window.data_wait_s += waited
                    if self.parallel is not None and cfg.noise_std > 0:
                        # each rank its own noise, drawn alike when a run with the same ranks is resumed
                        torch.manual_seed((loop.seed * 1_000_003 + state.step) * 1_009 + self.rank)
                    out = train_step(self.model, group, self.optimizer, self.scheduler, self.verifier_lm_head, cfg,
                                     parallel=self.parallel, weights=[weight for _, weight in share])
                    self._check_finite(out, group, [plan[i] for i, _ in share])
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
                self.train_set.mark_checked(p for batch in reading for p in batch)
        self.metrics.close()
        return self.summary(best=state.best_checkpoint, best_value=state.best_value, last_eval=self.last_eval)

    def _check_finite(self, out: dict[str, Any], group: list[dict], positions: list[list[int]]) -> None:
        if out["finite"]:
            self.state.nonfinite_in_a_row = 0
            return
        self.state.nonfinite_in_a_row += 1
        self.log.warning("step %d: non-finite loss or gradient norm; update skipped. %s", self.state.step + 1,
                         self._name_nonfinite(group, positions))
        if self.state.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
            raise RuntimeError(f"training diverged: {MAX_NONFINITE_IN_A_ROW} non-finite gradients in a row at "
                               f"step {self.state.step + 1}; lower --lr or --max-grad-norm, or check the data")

    def _name_nonfinite(self, group: list[dict], positions: list[list[int]]) -> str:
        """Which samples of the step: those whose stored hidden states hold NaN/inf, else all of this rank's."""
        entries = self.train_set.entries
        ids = [entries[p]["id"] for batch in positions for p in batch]
        bad = [entries[p]["id"] for batch, micro in zip(positions, group) for row, p in enumerate(batch)
               if not states_finite(micro, row)]
        if bad:
            return self._nonfinite_states_advice(bad)
        return f"Its inputs are finite; its samples (this rank): {', '.join(map(repr, ids[:50]))}"

    def _nonfinite_states_advice(self, bad: list) -> str:
        """What NaN/inf in these samples' states means. Read from stage 02's files, the files changed after they
        were written (stage 02 refuses to write such states), so the way on is its --verify, not the verifier."""
        if self.source.online:
            return (f"Samples whose states the verifier computed with NaN/inf: {', '.join(map(repr, bad[:20]))}; check "
                    f"the verifier's weights and --dtype")
        from eagle3_pipeline.formats.hidden_states import repair_command

        return (f"Samples with NaN/inf in their stored hidden states: {', '.join(map(repr, bad[:20]))}. Stage 02 "
                f"checks the states before it writes them, so these files changed afterwards (or were written "
                f"before that check): find and redo the damaged samples with "
                f"{repair_command(self.train_set.data_dir)}")

    def _after_step(self, window: MetricsWindow, progress: Progress, epoch: int, epoch_end: bool) -> str | None:
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

    def _write_train_line(self, window: MetricsWindow, epoch: int) -> None:
        reduce = self._reduce_window if self.parallel is not None else None
        line = {"kind": "train", "step": self.state.step, "epoch": epoch, **window.flush(self.cfg.ttt_decay, reduce)}
        device = model_device(self.model)
        if device.type == "cuda":  # this rank's peak so far (the verifier's weights included when --online)
            line["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
        self.metrics.write(line)

    def _stop_requested(self, stop: StopRequests) -> bool:
        if self.parallel is None:
            return stop.received is not None
        # Every rank must stop after the same step (the next one would wait for the others' gradients): a signal
        # seen by any rank stops them all. One tiny reduction a step.
        flag = torch.tensor([float(stop.received is not None)], dtype=torch.float64, device=model_device(self.model))
        return bool(self.parallel.reduce_sums({"stop": flag})["stop"].item() > 0)

    def _stop_here(self, window: MetricsWindow, epoch: int, saved: str | None) -> None:
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
        loader = make_loader(self.val_set, mine, self.loop.num_workers, self.cfg.device, self.loop.seed,
                             pad_to=self.loop.pad_to)
        started = time.time()
        with self.parallel.full_parameters() if self.parallel is not None else nullcontext():
            result = evaluate(self.model, read_batches(loader), self.verifier_lm_head, self.cfg.ttt_steps,
                              decay=self.cfg.ttt_decay, reduce=self._reduce_sums if self.parallel is not None else None,
                              batch_to_device=self.source.complete)
            self.val_set.mark_checked(p for batch in mine for p in batch)
            self._check_validation_finite(result, mine)
        result = {"kind": "eval", "step": self.state.step, "epoch": epoch, **result,
                  "seconds": round(time.time() - started, 3)}
        self.metrics.write(result)
        self.last_eval = result
        self.log.info("validation at step %d: %s, loss %.4f, top-1 agreement per TTT step %s (%d tokens)",
                      self.state.step, figures_text(result), result["loss"],
                      [round(a, 3) for a in result["acc_per_step"]], result["tokens"])
        return result

    def _check_validation_finite(self, result: dict[str, Any], mine: list[list[int]]) -> None:
        """A validation loss or metric that is NaN/inf stops the run naming the samples: a best checkpoint chosen
        by it would mean nothing."""
        values = [result["loss"], result["sim_accept_len"], result.get("sim_chain_tau", 0.0),
                  *result["loss_per_step"], *result["acc_per_step"]]
        if all(math.isfinite(value) for value in values):
            return
        raise StageFailure(f"validation at step {self.state.step}: loss {result['loss']}; it or the figures from it are "
                           f"not finite. {self._name_nonfinite_validation(mine)}")

    def _name_nonfinite_validation(self, mine: list[list[int]]) -> str:
        """The validation samples behind a non-finite result (this rank's): those with NaN/inf in their states,
        else those of the batches whose loss alone is not finite."""
        entries, device = self.val_set.entries, model_device(self.model)
        bad, culprits = [], []
        for batch in mine:
            ready = self.source.complete(collate([self.val_set[p] for p in batch], self.loop.pad_to), device)
            bad += [entries[p]["id"] for row, p in enumerate(batch) if not states_finite(ready, row)]
            alone = evaluate(self.model, [ready], self.verifier_lm_head, self.cfg.ttt_steps, decay=self.cfg.ttt_decay,
                             batch_to_device=lambda ready_batch, _: ready_batch)
            if not math.isfinite(alone["loss"]):
                culprits += [entries[p]["id"] for p in batch]
        if bad:
            return self._nonfinite_states_advice(bad)
        return (f"Their states are finite, so the drafter's outputs are not; the samples of the batches whose loss is "
                f"not finite (this rank): {', '.join(map(repr, culprits[:50])) or 'none alone'}. Lower --lr or "
                f"--max-grad-norm, or train in float32 (--dtype)")

    # --- sums over the ranks --------------------------------------------------------------------------
    def _zero_sums(self) -> dict[str, torch.Tensor]:
        device = model_device(self.model)
        return {key: torch.zeros(self.cfg.ttt_steps, dtype=torch.float64, device=device)
                for key in ("loss_sum", "correct", "count")}

    def _reduce_sums(self, sums: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Validation sums over the ranks; a rank without batches adds zeros under the same keys."""
        if sums is None:
            zero = torch.zeros((), dtype=torch.float64, device=model_device(self.model))
            sums = {**self._zero_sums(), "chain_verify_steps": zero, "chain_tokens": zero}
        return self.parallel.reduce_sums(sums)

    def _reduce_window(self, sums, loss, tokens):
        """A metrics window's (sums, loss, tokens) summed over the ranks (train_step gives each rank's part)."""
        device = model_device(self.model)
        parts = dict(sums if sums is not None else self._zero_sums())
        parts["loss"] = torch.as_tensor(loss, dtype=torch.float64, device=device)
        parts["tokens"] = torch.as_tensor(tokens, dtype=torch.float64, device=device)
        out = self.parallel.reduce_sums(parts)
        return {key: out[key] for key in ("loss_sum", "correct", "count")}, out["loss"], out["tokens"]

    def _update_best(self, name: str, evaluated: dict[str, Any] | None, epoch_end: bool) -> str | None:
        """The reason `name` becomes `best`, or None. Best is the highest validation TTT acceptance estimate;
        with no validation split, the latest epoch; until anything is measured, the latest save
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
                               val_sim_chain_tau=evaluated.get("sim_chain_tau") if evaluated else None,
                               run_config=self.run_config)
        # (under FSDP both gather whole tensors: every rank takes part, rank 0 writes)
        model = self.model if self.parallel is None else self.parallel.export_model()
        path = self.checkpoints.save(name, model, self.training_state(), summary)
        if reason is not None:
            self.checkpoints.point(BEST, name, {**summary, "metric": reason})
        removed = self.checkpoints.prune()
        self.log.info("saved checkpoint %s%s%s", path, f" (best: {reason})" if reason else "",
                      f"; pruned {', '.join(removed)}" if removed else "")
