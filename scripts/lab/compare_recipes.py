#!/usr/bin/env python3
"""Our drafter against SpecForge 0.2.0's recipe on the same data, side by side: one table of tau and training time.

  python scripts/lab/compare_recipes.py --run-dir RUN_DIR --model-path VERIFIER [--mt-bench FILE] [--output-dir DIR]

RUN_DIR has stages 01-04 done (our drafter in RUN_DIR/checkpoints/best). In order, each part skipped when its
output is already there (so a stopped comparison resumes; --redo to redo them):
  train  scripts/lab/train_specforge_recipe.py: SpecForge's drafter on the same samples, epochs, lr and TTT steps
         -> RUN_DIR/specforge/best, RUN_DIR/specforge/specforge_results.json
  bench  05_benchmark.py --tau-only for both drafters: chain k=3 (--num-steps 3 --topk 1 --num-draft-tokens 4),
         T=0, on MT-bench (all 80 by default) and the held-out split (RUN_DIR/data/eval_data.jsonl)
         -> OUTPUT_DIR/{ours,specforge}_{mt_bench,heldout}/
         and 05_benchmark.py --mode eval --num-steps 3 for both: teacher-forced TTT acceptance estimate on
         our stage 04's validation split (seconds; informative, not part of the target)
  table  tau per set, ours/SpecForge with its 95 % paired bootstrap interval over prompts and the prompts where
         ours is higher / lower, training wall time and its ratio, against the target (ours >= 1.05x
         SpecForge's tau on every set in <= 0.7x its training time) -> OUTPUT_DIR/compare.{json,md}, printed
--parts picks some of them (e.g. --parts bench table). Settings of stage 05 (--max-new-tokens, --num-prompts,
--device, --dtype) and of the recipe (--recipe-args "--time-limit 500") pass through; --jobs N runs N benchmarks
at once (tau only: they share the GPU, so their speeds mean nothing).
Training times: ours is our stage 04 manifest's wall_time_s (set-up, training, validation, checkpoints);
SpecForge's is its total_s (set-up, training, export: no validation).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TAU_TARGET, TIME_TARGET = 1.05, 0.7
CHAIN = ["--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4", "--temperature", "0"]
PARTS = ("train", "bench", "table")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--model-path", required=True, help="the verifier")
    p.add_argument("--mt-bench", type=Path, default=REPO.parent / "shared" / "bench" / "mt_bench.jsonl",
                   help="MT-bench prompts (default ../shared/bench/mt_bench.jsonl)")
    p.add_argument("--heldout", type=Path, help="held-out prompts (default RUN_DIR/data/eval_data.jsonl)")
    p.add_argument("--ours", type=Path, help="our stage 04 output folder, another recipe's on the same run "
                   "(default RUN_DIR/checkpoints; SpecForge's recipe takes its epochs, lr and TTT steps from there)")
    p.add_argument("--output-dir", type=Path, help="default RUN_DIR/compare")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--redo", action="store_true", help="redo parts whose output exists")
    p.add_argument("--max-new-tokens", type=int, help="stage 05's (its default 256)")
    p.add_argument("--num-prompts", type=int, help="stage 05's, per set (default: every prompt)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", help="stage 05's (its default bfloat16)")
    p.add_argument("--decode-workers", type=int, help="stage 05's, for each decoding run (processes per run)")
    p.add_argument("--recipe-args", default="", help="more flags for train_specforge_recipe.py, one string")
    p.add_argument("--jobs", type=int, default=1, help="benchmarks run at once (each writes its own folder; "
                   "on one GPU they share it, so use this for tau, never for timings)")
    args = p.parse_args(argv)
    args.output_dir = args.output_dir or args.run_dir / "compare"
    args.heldout = args.heldout or args.run_dir / "data" / "eval_data.jsonl"
    args.ours = args.ours or args.run_dir / "checkpoints"
    return args


def drafters(args) -> dict[str, Path]:
    return {"ours": args.ours / "best", "specforge": args.run_dir / "specforge" / "best"}


def prompt_sets(args) -> dict[str, Path]:
    return {"mt_bench": args.mt_bench, "heldout": args.heldout}


def die(message: str, code: int) -> None:
    print(f"compare_recipes: {message}", file=sys.stderr)
    sys.exit(code)


def launch(command: list[str]) -> int:
    print("+ " + shlex.join(command), flush=True)
    return subprocess.run(command, cwd=REPO).returncode


def run(command: list[str]) -> None:
    code = launch(command)
    if code != 0:
        die(f"{command[1]} failed with exit code {code}; see its log above", code)


def run_all(commands: list[list[str]], jobs: int) -> None:
    """Run the commands, `jobs` at a time; exit with the first failure's code once all have ended."""
    if jobs <= 1:
        for command in commands:
            run(command)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        codes = list(pool.map(launch, commands))
    failed = [(command, code) for command, code in zip(commands, codes) if code != 0]
    if failed:
        die(f"{len(failed)} benchmark(s) failed, the first with exit code {failed[0][1]}: "
            f"{shlex.join(failed[0][0])}; see the logs above", failed[0][1])


def train(args) -> None:
    results = args.run_dir / "specforge" / "specforge_results.json"
    if results.exists() and not args.redo:
        print(f"train: {results} exists (--redo to train again)")
        return
    run([sys.executable, "scripts/lab/train_specforge_recipe.py", "--run-dir", str(args.run_dir), "--model-path",
         args.model_path, "--device", args.device, *shlex.split(args.recipe_args)])


def bench_output(args, drafter: str, prompt_set: str) -> Path:
    return args.output_dir / f"{drafter}_{prompt_set}"


def bench_result(folder: Path) -> dict | None:
    from eagle3_pipeline.bench.report import read_reports

    found = [results for path, results in read_reports(folder, "bench_offline_") if "_tau" in path.stem]
    return found[-1] if found else None


def eval_result(folder: Path) -> dict | None:
    from eagle3_pipeline.bench.report import latest_report

    return latest_report(folder, "bench_eval_")


def bench(args) -> None:
    extra = []
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--num-prompts", args.num_prompts),
                        ("--dtype", args.dtype), ("--decode-workers", args.decode_workers)):
        if value is not None:
            extra += [flag, str(value)]
    commands = []
    for prompt_set, prompts in prompt_sets(args).items():
        for name, drafter in drafters(args).items():
            out = bench_output(args, name, prompt_set)
            if bench_result(out) is not None and not args.redo:
                print(f"bench: {out} has its result (--redo to measure again)")
                continue
            commands.append([sys.executable, "05_benchmark.py", "--mode", "offline", "--tau-only", "--run-dir",
                             str(args.run_dir), "--model-path", args.model_path, "--draft-model-path", str(drafter),
                             "--prompts", str(prompts), "--output-dir", str(out), "--device", args.device, *CHAIN,
                             *extra])
    for name, drafter in drafters(args).items():
        out = bench_output(args, name, "validation")
        if eval_result(out) is not None and not args.redo:
            print(f"bench: {out} has its result (--redo to measure again)")
            continue
        commands.append([sys.executable, "05_benchmark.py", "--mode", "eval", "--num-steps", "3", "--run-dir",
                         str(args.run_dir), "--model-path", args.model_path, "--draft-model-path", str(drafter),
                         "--output-dir", str(out), "--device", args.device,
                         *([] if args.dtype is None else ["--dtype", args.dtype])])
    run_all(commands, args.jobs)


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def paired_prompts(results: list[dict], folders: list[Path]) -> tuple[list, list]:
    """Both drafters' per-prompt (tokens, verify steps), paired by prompt id."""
    from eagle3_pipeline.bench.metrics import tau_parts

    ours, theirs = ({p["id"]: tau_parts(p["summary"]) for p in r["prompts"]} for r in results)
    if ours.keys() != theirs.keys():
        die(f"{folders[0]} and {folders[1]} hold results for different prompts ({len(ours.keys() - theirs.keys())} "
            f"only in the first, {len(theirs.keys() - ours.keys())} only in the second): --redo the bench part", 2)
    ids = sorted(ours)
    return [ours[i] for i in ids], [theirs[i] for i in ids]


def set_row(args, prompt_set: str) -> dict:
    """One prompt set's taus, their ratio and, when both drafters have a result, its spread over prompts."""
    from eagle3_pipeline.bench.metrics import higher_lower_equal, paired_ratio_interval

    folders = [bench_output(args, name, prompt_set) for name in drafters(args)]
    results = [bench_result(folder) for folder in folders]
    ours, sf = (r["overall"]["tau"] if r else None for r in results)
    row = {"set": prompt_set, "ours": ours, "specforge": sf, "ratio": ratio(ours, sf),
           "ratio_interval_95": None, "prompts_higher_lower_equal": None}
    if all(results):
        pairs = paired_prompts(results, folders)
        row["ratio_interval_95"] = [round(x, 3) for x in paired_ratio_interval(*pairs, level=0.95)]
        row["prompts_higher_lower_equal"] = list(higher_lower_equal(*pairs))
    return row


def interval_cell(interval: list | None) -> str:
    return "-" if interval is None else f"{interval[0]:.3f} - {interval[1]:.3f}"


def counts_cell(counts: list | None) -> str:
    return "-" if counts is None else f"{counts[0]} / {counts[1]}" + (f" ({counts[2]} equal)" if counts[2] else "")


def table(args) -> dict:
    from eagle3_pipeline.formats.files import read_json, write_json_atomic, write_text_atomic

    if not (args.run_dir / "specforge" / "specforge_results.json").exists():
        die(f"no {args.run_dir / 'specforge' / 'specforge_results.json'}: run the train part first", 2)
    sf = read_json(args.run_dir / "specforge" / "specforge_results.json")
    ours_manifest = read_json(args.ours / "manifest.json")
    rows = [set_row(args, prompt_set) for prompt_set in prompt_sets(args)]
    validation = {}
    for name in drafters(args):
        result = eval_result(bench_output(args, name, "validation"))
        validation[name] = result["metrics"]["sim_accept_len"] if result else None
    ours_s, sf_s = ours_manifest.get("wall_time_s"), sf.get("total_s")
    time_ratio = ratio(ours_s, sf_s)
    tau_ok = all(r["ratio"] is not None and r["ratio"] >= TAU_TARGET for r in rows)
    interval_ok = all(r["ratio_interval_95"] is not None and r["ratio_interval_95"][0] >= TAU_TARGET for r in rows)
    report = {"sets": rows, "validation_sim_accept_len": {**validation, "ratio": ratio(validation["ours"],
                                                                                       validation["specforge"])},
              "training": {"ours_s": ours_s, "specforge_s": sf_s, "specforge_loop_s": sf.get("wall_time_s"),
                                         "ratio": time_ratio, "specforge_steps": sf.get("steps"),
                                         "specforge_tokens_per_s": sf.get("tokens_per_s"),
                                         "specforge_stopped_early": sf.get("stopped_early")},
              "target": {"tau_ratio_min": TAU_TARGET, "time_ratio_max": TIME_TARGET, "tau_holds": tau_ok,
                         "tau_interval_holds": interval_ok,
                         "time_holds": time_ratio is not None and time_ratio <= TIME_TARGET},
              "specforge_settings": sf.get("settings"), "specforge_setting_sources": sf.get("setting_sources")}
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    holds = lambda ok: "holds" if ok else "does not hold"  # noqa: E731
    lines = ["| set | tau ours | tau SpecForge | ours / SpecForge | 95 % interval (paired bootstrap over prompts) | "
             "prompts: ours higher / lower |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['set']} | {fmt(r['ours'])} | {fmt(r['specforge'])} | {fmt(r['ratio'])} | "
              f"{interval_cell(r['ratio_interval_95'])} | {counts_cell(r['prompts_higher_lower_equal'])} |"
              for r in rows]
    lines.append(f"| validation split, teacher-forced TTT acceptance estimate (k=3) | {fmt(validation['ours'])} | "
                 f"{fmt(validation['specforge'])} | {fmt(report['validation_sim_accept_len']['ratio'])} | - | - |")
    lines.append(f"| training wall time (s) | {fmt(ours_s)} | {fmt(sf_s)} | {fmt(time_ratio)} | - | - |")
    lines.append("")
    lines.append(f"Target: ours >= {TAU_TARGET}x SpecForge's tau on every set ({holds(tau_ok)}; 95 % interval's low "
                 f"end >= {TAU_TARGET} on every set: {holds(interval_ok)}) "
                 f"in <= {TIME_TARGET}x its training time ({holds(report['target']['time_holds'])}). "
                 f"Chain k=3 (3-1-4), T=0, stage 05 --tau-only. SpecForge: {sf.get('steps')} steps of one sequence, "
                 f"settings {json.dumps(sf.get('settings'))}.")
    if sf.get("stopped_early"):
        lines.append(f"SpecForge's training stopped early ({sf['stopped_early']}): not a like-for-like comparison.")
    text = "\n".join(lines) + "\n"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.output_dir / "compare.json", report)
    write_text_atomic(args.output_dir / "compare.md", text)
    print(text)
    return report


def main(argv=None) -> int:
    args = parse(argv)
    for path, what in ((args.ours / "best" / "config.json", "our drafter (stage 04)"),
                       (args.mt_bench, "--mt-bench"), (args.heldout, "--heldout")):
        if "bench" in args.parts and not Path(path).exists():
            die(f"{what} not found at {path}", 2)
    if "train" in args.parts:
        train(args)
    if "bench" in args.parts:
        bench(args)
    if "table" in args.parts:
        table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
