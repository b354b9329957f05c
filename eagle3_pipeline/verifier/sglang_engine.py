"""SGLang's engine in a child process that stage 02 supervises.

SGLang answers an exception in a scheduler process by sending SIGQUIT to the scheduler's parent, the process
that made the Engine, whose handler kills its whole process tree, itself included (alike in every checked release,
0.5.17 and 0.5.23: `sglang/srt/managers/scheduler.py` run_scheduler_process, `sglang/srt/entrypoints/engine.py`
_set_envs_and_config).
With the Engine in stage 02's own process, a failure in the capture hooks would kill stage 02 before it could log
why, exit 1 or mark its manifest. So the Engine and its `generate` calls live in a child process; stage 02 feeds it
request chunks through a queue and watches whether it is alive (docs/extraction.md).
"""
from __future__ import annotations

import importlib
import multiprocessing
import queue
import time
import traceback
from typing import Any

SGLANG_ENGINE = "sglang.srt.entrypoints.engine:Engine"  # module:class the child starts (tests name a stand-in)
STOP_TIMEOUT_S = 120.0


class EngineDied(RuntimeError):
    """The engine's process ended before its work was done (SGLang killed it, or it raised)."""


def aborted_requests(outputs: Any) -> list[tuple[int, str]]:
    """(index in the call, message) of each request SGLang aborted (never computed, so never written)."""
    found = []
    for index, output in enumerate(outputs if isinstance(outputs, list) else [outputs]):
        reason = ((output or {}).get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            found.append((index, str(reason.get("message") or reason)))
    return found


def _engine_main(engine_path: str, kwargs: dict, requests: Any, results: Any) -> None:
    """The child: start the Engine, then run each (number, rids, input_ids) chunk until None arrives."""
    try:
        module, name = engine_path.split(":")
        engine_class = getattr(importlib.import_module(module), name)
        started = time.perf_counter()
        engine = engine_class(**kwargs)
        results.put(("ready", time.perf_counter() - started))
        try:
            while (item := requests.get()) is not None:
                number, rids, input_ids = item
                outputs = engine.generate(input_ids=input_ids, sampling_params={"max_new_tokens": 0}, rid=rids)
                results.put(("done", number, aborted_requests(outputs)))
        finally:
            engine.shutdown()
    except BaseException:  # noqa: BLE001 - reported to stage 02, which says what to do
        results.put(("error", traceback.format_exc()))
        raise SystemExit(1)


class EngineProcess:
    """The supervised child: `start`, `wait_ready`, `submit` chunks, `messages`, `stop`."""

    def __init__(self, kwargs: dict, engine_path: str = SGLANG_ENGINE):
        context = multiprocessing.get_context("spawn")  # CUDA and SGLang's own processes need a fresh interpreter
        self._requests = context.Queue()
        self._results = context.Queue()
        self.process = context.Process(target=_engine_main, args=(engine_path, kwargs, self._requests, self._results),
                                       name="sglang-engine", daemon=False)
        self.error: str | None = None

    def start(self) -> "EngineProcess":
        self.process.start()
        return self

    def describe_exit(self) -> str:
        code = self.process.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}")
        text = f"SGLang's engine process (pid {self.process.pid}) {how}"
        if code is not None and code < 0:
            text += " (SGLang kills the engine's process when one of its scheduler processes fails)"
        return text + (f"; its error:\n{self.error}" if self.error else "")

    def messages(self, timeout: float = 0.5) -> list[tuple]:
        """What the child reported since the last call (waits up to `timeout` s for the first); raises EngineDied
        once it has ended early."""
        found = []
        try:
            found.append(self._results.get(timeout=timeout))
            while True:
                found.append(self._results.get_nowait())
        except queue.Empty:
            pass
        for message in found:
            if message[0] == "error":
                self.error = message[1]
        if self.error is not None or (not found and not self.process.is_alive()):
            self.process.join(5)
            raise EngineDied(self.describe_exit())
        return found

    def wait_ready(self, check=lambda: None) -> float:
        """Wait for the Engine to load (minutes for a large verifier), calling `check()` meanwhile; its load time."""
        while True:
            for message in self.messages():
                if message[0] == "ready":
                    return message[1]
            check()

    def submit(self, number: int, rids: list[str], input_ids: list[list[int]]) -> None:
        self._requests.put((number, rids, input_ids))

    def stop(self, graceful: bool = True) -> None:
        """Shut the Engine down (it frees the GPUs), or end the process at once (graceful=False, after a failure,
        when it may still be loading) or when it does not answer. SGLang's scheduler processes die with it (they
        ask the kernel for SIGKILL when their parent dies: sglang/srt/utils/common.py kill_itself_when_parent_died)."""
        if graceful and self.process.is_alive():
            self._requests.put(None)
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._requests.cancel_join_thread()  # chunks a dead child never read must not hold stage 02 at exit
