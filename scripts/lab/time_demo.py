"""Time the README's first command, scripts/demo.sh, in a fresh run folder, stage by stage.

    .venv/bin/python scripts/lab/time_demo.py [--run-dir runs/time_demo_STAMP] [-- extra demo.sh flags]

Runs `bash scripts/demo.sh` with RUN_DIR set to a folder that does not exist yet (so no stage is skipped), keeps
its console output in RUN_DIR.out, and writes RUN_DIR/demo_time.json and demo_time.md: the whole command's wall
time, each stage's time as its log says it ("NN_name finished in X s"), the rest (environment setup, imports,
the runner), and the machine: CPU model, cores, torch's threads, a GPU if any, and the load average before, during
(sampled every 10 s) and after, since other work on the machine slows the demo down.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from eagle3_pipeline.formats.files import write_json_atomic, write_text_atomic

REPO = Path(__file__).resolve().parents[2]

STAGES = ("01_prepare_data", "02_extract_hidden_states", "03_build_vocab_mapping", "04_train", "05_benchmark")
FINISHED = re.compile(r"(\d\d_\w+) finished in ([\d.]+) s")
LOAD_SAMPLE_S = 10.0


def load_average() -> float:
    """The 1-minute load average (runnable processes, averaged): about the cores in use."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    python = REPO / ".venv" / "bin" / "python"
    probe = ("import torch; print(torch.get_num_threads(), "
             "torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')")
    try:
        threads, gpu = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                                      check=True).stdout.strip().partition(" ")[::2]
    except (OSError, subprocess.CalledProcessError):
        threads, gpu = "?", ""  # demo.sh makes .venv itself: the probe may come before it exists
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": threads, "gpu": gpu or None}


class LoadSampler:
    """The load average every LOAD_SAMPLE_S seconds while the demo runs."""

    def __init__(self):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(LOAD_SAMPLE_S):
            self.samples.append(load_average())

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def stage_times(run_dir: Path) -> dict[str, float | None]:
    """Each stage's seconds, from the last "finished in" line of its log (None: the log has none)."""
    times: dict[str, float | None] = {}
    for stage in STAGES:
        log = run_dir / "logs" / f"{stage}.log"
        found = FINISHED.findall(log.read_text(errors="replace")) if log.exists() else []
        times[stage] = float(found[-1][1]) if found else None
    return times


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def markdown(report: dict) -> str:
    load = report["load_average"]
    lines = [f"# scripts/demo.sh timed ({report['date']})", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, torch threads "
             f"{report['machine']['torch_threads']}, GPU: {report['machine']['gpu'] or 'none'}. Load average "
             f"before {load['before']}, during {load['during_mean']} (mean; max {load['during_max']}), after "
             f"{load['after']}. Exit code {report['exit_code']}.", "",
             "| part | seconds | time |", "| --- | ---: | --- |"]
    for stage, seconds in report["stages"].items():
        lines.append(f"| {stage} | {seconds if seconds is not None else '-'} | "
                     f"{minutes(seconds) if seconds is not None else 'no finished line in its log'} |")
    rest = report["other_s"]
    lines.append(f"| the rest (setup_env.sh, imports, the runner) | {rest} | {minutes(rest)} |")
    lines.append(f"| **the whole command** | **{report['total_s']}** | **{minutes(report['total_s'])}** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", help="a folder that does not exist yet (default: runs/time_demo_STAMP)")
    parser.add_argument("demo_args", nargs="*", help="flags passed on to scripts/demo.sh (after --)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir or REPO / "runs" / time.strftime("time_demo_%Y%m%d_%H%M%S")).resolve()
    if run_dir.exists():
        parser.error(f"--run-dir {run_dir} exists: the demo would skip its finished stages; give a new folder")
    console = run_dir.with_name(run_dir.name + ".out")
    console.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no runs/ yet
    before = load_average()
    started = time.time()
    with LoadSampler() as sampler, open(console, "w") as out:
        code = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), *args.demo_args], cwd=REPO,
                              env={**os.environ, "RUN_DIR": str(run_dir)}, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    total = round(time.time() - started, 1)
    stages = stage_times(run_dir)
    during = sampler.samples or [load_average()]
    report = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(["bash scripts/demo.sh", *args.demo_args]),
              "run_dir": str(run_dir), "console": str(console), "exit_code": code, "total_s": total,
              "stages": stages, "other_s": round(total - sum(s for s in stages.values() if s is not None), 1),
              "machine": machine(),
              "load_average": {"before": before, "during_mean": round(sum(during) / len(during), 2),
                               "during_max": max(during), "after": load_average()}}
    run_dir.mkdir(parents=True, exist_ok=True)  # a demo that failed early may not have made it
    write_json_atomic(run_dir / "demo_time.json", report)
    write_text_atomic(run_dir / "demo_time.md", markdown(report))
    sys.stdout.write(markdown(report))
    print(f"written: {run_dir / 'demo_time.json'}, {run_dir / 'demo_time.md'}; console: {console}")
    return code


if __name__ == "__main__":
    sys.exit(main())
