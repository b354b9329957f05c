"""--decode-workers N: stage 05's offline decoding spread over N processes on one device.

Speculative decoding of one turn is a sequence of small, dependent steps: on a small verifier each step
waits mostly on Python and kernel launches, not on the GPU (SmolLM2 on an H200: about 0.3 turns/s per
process). Several processes, each with its own copy of the verifier and the drafter, decode different
prompts at once, and the GPU serves them side by side (best with CUDA MPS). The results are the same as one
process's: each turn's sampling is seeded by its prompt's place in the list and its turn (decode_prompt),
and the parent puts the prompts back in order. Timing runs (without --tau-only) stay in one process, as
processes sharing a device would slow each other's clocks.
"""
from __future__ import annotations

import queue
import tempfile
import traceback
from pathlib import Path
from typing import Callable

from eagle3_pipeline.bench.settings import BenchConfig, DecodingSettings
from eagle3_pipeline.errors import UsageError


def worker_count(decoding: DecodingSettings, prompt_count: int) -> int:
    """The processes to decode in: --decode-workers, at most one per prompt; checked against the mode."""
    workers = decoding.decode_workers
    if workers > 1 and not decoding.tau_only:
        raise UsageError(f"--decode-workers {workers} needs --tau-only: the timing baselines must run alone on the "
                         "device (processes sharing it slow each other's clocks); drop --decode-workers to time")
    return max(1, min(workers, prompt_count))


def decode_in_workers(config: BenchConfig, prompts: list, workers: int,
                      on_turn: Callable[[dict], None]) -> tuple[list, list]:
    """Decode `prompts` in `workers` spawned processes, prompt i in process i % workers: (the per-prompt
    entries, the per-prompt lists of teacher-forced states), in the prompts' order. `on_turn` gets each
    turn's record as it arrives. A worker's failure stops the others and is raised with its traceback."""
    import torch
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    messages = context.Queue()
    with tempfile.TemporaryDirectory(prefix="decode_workers_", dir=config.output_dir) as scratch:
        processes = []
        for worker in range(workers):
            share = [(index, prompts[index]) for index in range(worker, len(prompts), workers)]
            states_file = Path(scratch) / f"worker_{worker}.pt"
            process = context.Process(target=_worker_main, args=(config, share, states_file, messages),
                                      name=f"decode-worker-{worker}", daemon=True)
            process.start()
            processes.append(process)
        entries: dict[int, dict] = {}
        files = []
        try:
            while len(files) < workers:
                kind, payload = _next_message(messages, processes)
                if kind == "turn":
                    on_turn(payload)
                elif kind == "prompt":
                    index, entry = payload
                    entries[index] = entry
                elif kind == "done":
                    files.append(payload)
                else:
                    raise RuntimeError(f"a decode worker failed:\n{payload}")
        finally:
            for process in processes:
                if process.is_alive() and len(files) < workers:
                    process.terminate()
                process.join()
        states: dict[int, list] = {}
        for path in files:
            states.update(torch.load(path, weights_only=True))
    order = range(len(prompts))
    return [entries[index] for index in order], [states[index] for index in order]


def _next_message(messages, processes) -> tuple[str, object]:
    """The next message from the workers; an error when one died without saying why (killed, out of memory)."""
    while True:
        try:
            return messages.get(timeout=5.0)
        except queue.Empty:
            dead = [p for p in processes if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"decode worker {dead[0].name} exited with code {dead[0].exitcode} without a "
                                   "result (killed? out of memory? its output is above in the log)")


def _worker_main(config: BenchConfig, share: list, states_file: Path, messages) -> None:
    """One worker: its own session (tokenizer, verifier, drafter, decoder), then its prompts in order."""
    import logging

    import torch

    from eagle3_pipeline.bench.offline_mode import decode_prompt, load_session, prepare_session

    try:
        log = logging.getLogger("05_benchmark.worker")
        session = prepare_session(config, log, checked=True)
        load_session(session, log)
        states = {}
        for index, prompt in share:
            entry, states[index] = decode_prompt(session, index, prompt, lambda record: messages.put(("turn", record)))
            messages.put(("prompt", (index, entry)))
        torch.save(states, states_file)
        messages.put(("done", states_file))
    except BaseException:  # noqa: BLE001 - the parent reports it and stops the run
        messages.put(("error", traceback.format_exc()))
