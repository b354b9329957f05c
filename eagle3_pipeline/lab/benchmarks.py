"""The stage-05 runs a lane can get, by name: what each measures and its flags.

Decoding runs measure acceptance only (--tau-only) with the chain SGLang serves (3 steps, top-1, 4 draft tokens);
each run writes its own folder, LANE/bench_<name>. The teacher-forced run (eval) reads the hidden states the
lane trained on, which the lane's plan adds.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.run_layout import EVAL_DATA_FILE, RUN_LAYOUT

CHAIN = ["--tau-only", "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4"]
TREE = ["--tau-only", "--num-steps", "3", "--topk", "8"]


@dataclass(frozen=True)
class Benchmark:
    name: str
    meaning: str
    sampled: bool = False  # decoded at T > 0: the storage-format lanes, compared at T=0, skip it
    default_only: bool = False  # the lossless checks: once, on the default lane
    reads_states: bool = False  # reads stage 02's stored states: not for a lane trained --online


BENCHMARKS = {b.name: b for b in (
    Benchmark("eval", "teacher-forced agreement per TTT step on the validation split (--mode eval); not for lanes "
              "trained --online", reads_states=True),
    Benchmark("mtbench", "chain 3/1/4 at T=0 on every MT-bench question, both turns"),
    Benchmark("heldout", "chain 3/1/4 at T=0 on a stratified sample of the base run's held-out prompts"),
    Benchmark("mtbench_t1", "chain 3/1/4 at T=1 on MT-bench", sampled=True),
    Benchmark("heldout_t1", "chain 3/1/4 at T=1 on the held-out sample", sampled=True),
    Benchmark("specbench", "chain 3/1/4 at T=0 on --spec-bench-prompts of Spec-Bench, spread over its categories"),
    Benchmark("fp32_chain", "chain 3/1/4 in float32 on MT-bench (lossless: every turn checked)", default_only=True),
    Benchmark("fp32_tree", "tree 3 steps x top-8 in float32 on MT-bench", default_only=True),
    Benchmark("fp64_chain", "chain 3/1/4 in float64 on MT-bench (no near tie can flip)", default_only=True),
    Benchmark("fp64_tree", "tree 3 steps x top-8 in float64 on MT-bench", default_only=True),
)}


@dataclass(frozen=True)
class BenchSettings:
    """What the benchmarks' flags refer to (scripts/lab/run_lanes.py's flags of the same names)."""
    mt_bench: str | None = None  # MT-bench's questions (mt_bench.jsonl)
    heldout_prompts: str | None = None  # default: the base run's data/eval_data.jsonl
    heldout: int = 60  # held-out prompts decoded
    new_tokens: int | None = None  # new tokens a turn of every decoding run (None: stage 05's default)
    field_tokens: int | None = None  # mtbench's at T=0 instead (e.g. 2048, as SpecForge's benchmarks decode)
    eval_steps: int = 7  # TTT steps the teacher-forced run scores
    spec_bench: str | None = None  # Spec-Bench's questions (spec_bench.jsonl)
    spec_bench_prompts: int = 120  # of them decoded, spread over its categories by stage 05


def check_names(names: list[str]) -> None:
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        raise UsageError(f"no benchmark called {', '.join(unknown)}; the benchmarks are {', '.join(BENCHMARKS)}")


def benchmark_flags(name: str, settings: BenchSettings, base_run: Path) -> list[str]:
    """Stage 05's flags for one benchmark (the drafter, output folder and hidden states come from the lane)."""
    if name == "eval":
        return ["--mode", "eval", "--num-steps", str(settings.eval_steps)]
    tokens = ["--max-new-tokens", str(settings.new_tokens)] if settings.new_tokens else []
    if name.startswith("heldout"):
        prompts = settings.heldout_prompts or str(base_run / RUN_LAYOUT["01_prepare_data"] / EVAL_DATA_FILE)
        temperature = "1" if name.endswith("_t1") else "0"
        return CHAIN + ["--temperature", temperature, "--prompts", prompts, "--num-prompts", str(settings.heldout),
                        *tokens]
    if name == "specbench":
        if not settings.spec_bench:
            raise UsageError("the specbench benchmark decodes Spec-Bench: give --spec-bench FILE (spec_bench.jsonl)")
        return CHAIN + ["--temperature", "0", "--prompts", settings.spec_bench, "--num-prompts",
                        str(settings.spec_bench_prompts), *tokens]
    if not settings.mt_bench:
        raise UsageError(f"the {name} benchmark decodes MT-bench: give --mt-bench FILE (mt_bench.jsonl)")
    mt_bench = ["--prompts", settings.mt_bench]
    if name == "mtbench":
        field = ["--max-new-tokens", str(settings.field_tokens)] if settings.field_tokens else tokens
        return CHAIN + ["--temperature", "0", *mt_bench, *field]
    if name == "mtbench_t1":
        return CHAIN + ["--temperature", "1", *mt_bench, *tokens]
    precision, shape = name.split("_")  # the lossless checks: every turn against the verifier's greedy choice
    dtype = {"fp32": "float32", "fp64": "float64"}[precision]
    return (CHAIN if shape == "chain" else TREE) + ["--temperature", "0", "--dtype", dtype, *mt_bench, *tokens]
