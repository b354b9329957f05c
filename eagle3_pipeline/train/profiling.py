"""--profile-steps N: where stage 04's optimizer steps spend their time, from inside the real training loop.

scripts/lab/bench_train_step.py times the step alone on synthetic inputs already on the device. A real run adds the
data loader, host-to-device copies, metrics and progress; on a small drafter the loop measured about three times
the benchmark's step time (SmolLM2 on an H200, 2026-12-02), so the gap is looked for here. torch.profiler runs
over N steps after a warm-up; the tables (by operation: device time first, then host time) go to
OUTPUT_DIR/profile_steps.txt, and the log gives the wall time a step against the time the device was busy: a
device busy for a small share of the step means the host bounds it. The profiler adds its own host time to every
operation, so the N steps before it (when the run has room) are timed without it: the figure a run sees.
"""
from __future__ import annotations

import time
from pathlib import Path

from eagle3_pipeline.formats.files import write_text_atomic

PROFILE_FILE = "profile_steps.txt"
WARMUP_STEPS = 10  # compiled kernels, allocator and loader workers settle first


class StepProfiler:
    """A trainer hook (called after every optimizer step): after the warm-up, N steps timed alone (when the run
    has room for them), then N steps profiled."""

    def __init__(self, steps: int, output_dir: Path, device: str, log):
        self.steps, self.output_dir, self.device, self.log = steps, Path(output_dir), device, log
        self.phase = "waiting"  # then "timing" (when there is room), "profiling", "done"
        self.phase_step = 0  # the step the current phase began after
        self.started_at = 0.0
        self.unprofiled_ms: float | None = None
        self.profiler = None

    def __call__(self, trainer) -> None:
        step = trainer.state.step
        # after the warm-up, or earlier when the run is too short for it and the steps measured
        warmup = min(WARMUP_STEPS, max(1, trainer.total_steps - 2 * self.steps))
        if self.phase == "waiting" and step >= warmup:
            if trainer.total_steps - warmup >= 2 * self.steps:
                self._begin("timing", step)
            else:
                self._start_profiler(step)
        elif self.phase == "timing" and step >= self.phase_step + self.steps:
            self.unprofiled_ms = 1000 * self._elapsed() / self.steps
            self._start_profiler(step)
        elif self.phase == "profiling" and step >= self.phase_step + self.steps:
            self._finish(step)

    def _begin(self, phase: str, step: int) -> None:
        self._synchronize()
        self.phase, self.phase_step, self.started_at = phase, step, time.perf_counter()

    def _elapsed(self) -> float:
        self._synchronize()
        return time.perf_counter() - self.started_at

    def _synchronize(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)

    def _start_profiler(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities)
        self.profiler.start()
        self._begin("profiling", step)

    def _finish(self, step: int) -> None:
        on_device = self.device.startswith("cuda")
        wall = self._elapsed()
        self.profiler.stop()
        steps = step - self.phase_step
        averages = self.profiler.key_averages()
        device_s = device_busy_seconds(self.profiler.events())
        summary = (f"{steps} steps profiled (steps {self.phase_step + 1}-{step}): {1000 * wall / steps:.1f} ms a step"
                   + (f", the device busy {1000 * device_s / steps:.1f} ms of it "
                      f"({100 * device_s / wall:.0f} %)" if on_device else " (CPU: no device time)")
                   + (f"; the {steps} steps before, without the profiler: {self.unprofiled_ms:.1f} ms a step"
                      if self.unprofiled_ms is not None else ""))
        tables = [summary, ""]
        if on_device:
            tables += ["By device time:", averages.table(sort_by="self_device_time_total", row_limit=25), ""]
        tables += ["By host time:", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
        path = self.output_dir / PROFILE_FILE
        write_text_atomic(path, "\n".join(tables) + "\n")
        self.log.info("--profile-steps: %s; tables in %s", summary, path)
        self.profiler, self.phase = None, "done"


def device_busy_seconds(events) -> float:
    """Seconds the device ran kernels and copies: the sum of a profile's device-side events (0 on a CPU)."""
    from torch.autograd import DeviceType

    return sum(event.device_time_total for event in events if event.device_type == DeviceType.CUDA) / 1e6
