"""Test-only faults, injected into a stage's own process (and every torchrun worker) from outside the library.

Python imports `sitecustomize` at start-up from the first folder on sys.path that holds one; tests/faults.py's
`fault_env` puts this folder (and the repository) first on PYTHONPATH, so production code carries no test hooks.

  EAGLE3_TEST_CRASH_AFTER_SAMPLES=N   stage 02's Extractor SIGKILLs its process (as the OOM killer would) once N
                                      samples are written
  EAGLE3_TEST_SIGNAL_AFTER_STEP=S:R   stage 04's rank R sends itself SIGTERM after optimizer step S (as a scheduler
                                      signalling one process of a job would)
"""
import os
import signal

CRASH_ENV = "EAGLE3_TEST_CRASH_AFTER_SAMPLES"
SIGNAL_ENV = "EAGLE3_TEST_SIGNAL_AFTER_STEP"


def _crash_after_samples(count: int) -> None:
    from eagle3_pipeline.extract.extractor import Extractor

    record = Extractor._samples_written

    def samples_written(self, indices, written_bytes):
        record(self, indices, written_bytes)
        if len(self.written()) >= count:
            os.kill(os.getpid(), signal.SIGKILL)
    Extractor._samples_written = samples_written


def _signal_after_step(step: int, rank: int) -> None:
    from eagle3_pipeline.train.trainer import Trainer

    if int(os.environ.get("RANK", "0")) != rank:
        return
    build = Trainer.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.hooks.append(lambda trainer: signal.raise_signal(signal.SIGTERM) if trainer.state.step == step else None)
    Trainer.__init__ = init


if os.environ.get(CRASH_ENV) or os.environ.get(SIGNAL_ENV):
    if os.environ.get(CRASH_ENV):
        _crash_after_samples(int(os.environ[CRASH_ENV]))
    if os.environ.get(SIGNAL_ENV):
        _signal_after_step(*(int(part) for part in os.environ[SIGNAL_ENV].split(":")))
