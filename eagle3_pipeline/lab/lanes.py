"""A lane is one experiment, declared as a record: its name, the stage flags it changes from a base run, the first
stage it reruns and the benchmarks it gets. This module holds the one grammar that composes lane names.

A name joins parts with "_": a data or storage-format part first when there is one (the data the lane trains on),
then recipe parts (changes to stage 04), applied left to right, so a later part's flag replaces an earlier one's:
sampled_epochs2, lr3_steps2_ttt7. Numbers are read against the base run's own stage-04 flags (lr10: ten times its
--lr), so a lane is one change from whatever recipe the base trains with. docs/lab.md lists every part.

A base that trains --online (its stage-04 flags say so) has no stage 02: its lanes rerun stages 01 and 03 only, and
the parts and benchmarks that need stored hidden states are refused or left out.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.run_layout import EVAL_DATA_FILE, RUN_LAYOUT
from eagle3_pipeline.cli.flags import FLAGS
from eagle3_pipeline.lab.argv import all_values, has_flag, last_value, merged
from eagle3_pipeline.lab.benchmarks import BENCHMARKS

PREPARE, EXTRACT, VOCAB = "01_prepare_data", "02_extract_hidden_states", "03_build_vocab_mapping"
TRAIN, BENCH = "04_train", "05_benchmark"
SPECFORGE = "scripts/lab/train_specforge_recipe"  # SpecForge's own recipe: the specforge lane's trainer
JOIN = "_"
# Names spelled with "_" inside one part before the grammar existed (scripts/lab/gpu_storage_formats.sh's variants).
ALIASES = {"bf16_final": "bf16final", "fp8_final": "fp8final", "bf16_topk": "bf16topk", "fp8_topk": "fp8topk"}


@dataclass(frozen=True)
class Knobs:
    """Values a part's meaning refers to that are not flags of the base run (scripts/lab/run_lanes.py's flags)."""
    lever_step_tokens: int = 2048  # the steps lane's tokens a step
    format_step_tokens: int = 16384  # the storage-format lanes' tokens a step
    data_samples: int = 17000  # prompts of the data and all lanes
    data_epochs: int = 2  # epochs of the data and all lanes
    data_turns: int = 2  # user turns a conversation of the all lane keeps
    data_extra: tuple[str, ...] = ()  # more chat files beside the base's --dataset for the data, all and made lanes
    long_tokens: int = 1024  # the long lane's longest reply


@dataclass(frozen=True)
class Base:
    """The run the lanes change: its folder, the flags each stage runs with (without --run-dir), the knobs."""
    run: Path
    flags: dict[str, list[str]]
    knobs: Knobs = Knobs()

    def flag(self, stage: str, name: str) -> str | None:
        """The base's value of a flag for a stage: as given, else the schema's default."""
        value = last_value(self.flags.get(stage, []), name)
        default = FLAGS[name].default if name in FLAGS else None
        return value if value is not None else (None if default is None else str(default))


@dataclass(frozen=True)
class Lane:
    name: str  # canonical, e.g. "sampled_epochs2"
    changes: dict[str, list[str]]  # per stage (or SPECFORGE): the flags that replace the base run's
    first_stage: str  # the first stage it reruns; the stages before it are the base run's
    benchmarks: tuple[str, ...]  # names in eagle3_pipeline.lab.benchmarks.BENCHMARKS, in order
    data: str = ""  # its data or storage-format part when that reruns stages before 04: their shared folder
    trainer: str = TRAIN  # the script that trains it
    after: tuple[str, ...] = field(default=())  # lanes whose drafter it needs first
    online: bool = False  # stage 04 computes the verifier's states (--online): no stage 02 to rerun or read
    trains_on_base_heldout: bool = False  # its data may hold the base run's held-out prompts (made lanes)


@dataclass(frozen=True)
class Part:
    spelling: str
    meaning: str


DATA_PARTS = (
    Part("sampled", "stage 01 regenerates the replies at T=0.8"),
    Part("mixed", "the greedy reply and one sampled at T=0.8 a prompt (--replies-per-prompt 2 --greedy-first-reply)"),
    Part("long", "replies regenerated up to --long-tokens new tokens"),
    Part("turns2", "two user turns a conversation, from sharegpt_turns2.json beside the base's --dataset"),
    Part("data", "--data-samples prompts (and --data-extra files) for --data-epochs epochs"),
    Part("all", "--data-samples conversations of --data-turns turns (and --data-extra) for --data-epochs epochs"),
    Part("madeN", "N more conversations the verifier makes (stage 01 --synthesize N), beside the base's --dataset "
                  "files and --data-extra; the base's epochs (made80000_epochs2: twice them); its held-out "
                  "benchmarks need --heldout-prompts"),
    Part("bf16final", "the base's hidden states, --format-step-tokens tokens a step: the formats' baseline"),
    Part("fp8final", "stage 02 with FP8 aux layers; --format-step-tokens tokens a step"),
    Part("bf16topk", "stage 02 with top-k targets (the base's --target-topk); --format-step-tokens tokens a step"),
    Part("fp8topk", "stage 02 with FP8 aux and top-k targets; --format-step-tokens tokens a step"),
    Part("auxA-B-C", "stage 02 with --aux-layers A,B,C"),
)
RECIPE_PARTS = (
    Part("default", "the base recipe, unchanged"),
    Part("specforge", "SpecForge 0.2.0's own recipe (scripts/lab/train_specforge_recipe.py), alone, after default"),
    Part("steps", "--lever-step-tokens tokens a step"),
    Part("lrX", "X times the base's --lr (lr3, lr0.5)"),
    Part("stepsX", "the base's --max-tokens-per-batch / X: X times the optimizer steps"),
    Part("bsN", "at most N sequences a step (--batch-size N)"),
    Part("epochs", "twice the base's --epochs"),
    Part("epochsX", "X times the base's --epochs"),
    Part("tttN", "--ttt-steps N"),
    Part("lk", "--loss lk"),
    Part("init", "--init-from-verifier-layer"),
    Part("fixed", "--ttt-positions fixed"),
    Part("mlp", "twice the verifier's intermediate_size (--drafter-config)"),
)
FORMATS = {"bf16final": [], "fp8final": ["--aux-dtype", "float8_e4m3"], "bf16topk": ["--targets", "topk"],
           "fp8topk": ["--aux-dtype", "float8_e4m3", "--targets", "topk"]}
FIXED = {"default": [], "lk": ["--loss", "lk"], "init": ["--init-from-verifier-layer"],
         "fixed": ["--ttt-positions", "fixed"]}
AUX = re.compile(r"aux(\d+)-(\d+)-(\d+)")
MADE = re.compile(r"made(\d+)")
NUMBERED = re.compile(r"(lr|steps|bs|epochs|ttt)(\d+(?:\.\d+)?)")


def canonical_name(name: str) -> str:
    """The name with an old spelling of its first part replaced (fp8_topk_epochs2 -> fp8topk_epochs2)."""
    for alias, spelling in ALIASES.items():
        if name == alias or name.startswith(alias + JOIN):
            return spelling + name[len(alias):]
    return name


def is_data_part(part: str) -> bool:
    return part in {p.spelling for p in DATA_PARTS} or any(rule.fullmatch(part) for rule in (AUX, MADE))


def trains_online(base: Base) -> bool:
    return has_flag(base.flags.get(TRAIN, []), "--online")


def unknown_part(name: str, part: str) -> UsageError:
    data = ", ".join(p.spelling for p in DATA_PARTS)
    recipe = ", ".join(p.spelling for p in RECIPE_PARTS)
    return UsageError(f"no lane called {name}: {part!r} is not a part. Data and storage-format parts (first in a "
                      f"name): {data}. Recipe parts: {recipe}. Join them with '_', e.g. sampled_lr3_ttt7")


# --- the base run's values a part reads -------------------------------------------------------------

def whole_number(name: str, part: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"lane {name}: {part!r} needs a whole number from 1 after {part.rstrip('0123456789.')!r}")
    return int(text)


def base_step_tokens(base: Base, name: str) -> int:
    tokens = base.flag(TRAIN, "--max-tokens-per-batch")
    if tokens is None:
        raise UsageError(f"lane {name} divides the base run's tokens a step, which it does not set: give them, "
                         f"e.g. --stage-args 04 \"--max-tokens-per-batch 4096\"")
    return int(tokens)


def verifier_mlp_width(base: Base, name: str) -> int:
    """The verifier's intermediate_size, from its config.json (a nested text_config for multimodal ones)."""
    model = base.flag(TRAIN, "--model-path")
    config_file = Path(model or "") / "config.json"
    if not model or not config_file.is_file():
        raise UsageError(f"lane {name} doubles the verifier's intermediate_size, read from its config.json: give "
                         f"--model-path as a local Hugging Face folder (got {model!r})")
    config = json.loads(config_file.read_text())
    width = config.get("intermediate_size") or (config.get("text_config") or {}).get("intermediate_size")
    if not width:
        raise UsageError(f"lane {name}: {config_file} has no intermediate_size to double")
    return int(width)


def dataset_folder(base: Base, name: str) -> Path:
    """The folder of the base run's first --dataset: the other chat files of a data lane lie beside it."""
    datasets = all_values(base.flags.get(PREPARE, []), "--dataset")
    if not datasets or ":" in datasets[0]:  # a hub name or pypi:..., not a file
        raise UsageError(f"lane {name} reads chat files beside the base run's --dataset: give stage 01's "
                         f"--dataset as a local file (got {datasets or 'none'})")
    return Path(datasets[0]).parent


def exclusions(base: Base, base_heldout: bool = True) -> list[str]:
    """Stage 01's --exclude-prompts for a lane with other prompts than the base's: the base's own (a lane's change
    replaces every value of a flag) and, with `base_heldout`, the base run's held-out prompts."""
    files = all_values(base.flags.get(PREPARE, []), "--exclude-prompts")
    if base_heldout:
        files.append(str(base.run / RUN_LAYOUT[PREPARE] / EVAL_DATA_FILE))
    return [token for file in files for token in ("--exclude-prompts", file)]


def with_extra_files(base: Base, name: str, files: list[str]) -> list[str]:
    """--dataset for every file a lane reads: `files` and the --data-extra files beside the base's first one."""
    files = files + [str(dataset_folder(base, name) / extra) for extra in base.knobs.data_extra]
    return [token for file in files for token in ("--dataset", file)]


# --- the parts --------------------------------------------------------------------------------------

def recipe_flags(part: str, base: Base, name: str) -> list[str]:
    """Stage 04's flags of one recipe part."""
    if part in FIXED:
        return FIXED[part]
    if part == "steps":
        return ["--max-tokens-per-batch", str(base.knobs.lever_step_tokens)]
    if part == "epochs":
        return ["--epochs", str(2 * int(base.flag(TRAIN, "--epochs")))]
    if part == "mlp":  # compact JSON, as the shell lanes wrote it
        size = {"intermediate_size": 2 * verifier_mlp_width(base, name)}
        return ["--drafter-config", json.dumps(size, separators=(",", ":"))]
    match = NUMBERED.fullmatch(part)
    if match is None:
        raise unknown_part(name, part)
    kind, number = match.groups()
    if kind == "lr":
        factor = float(number) if "." in number else int(number)
        if factor <= 0:
            raise UsageError(f"lane {name}: {part!r} needs a factor above 0")
        return ["--lr", repr(factor * float(base.flag(TRAIN, "--lr")))]
    count = whole_number(name, part, number)
    if kind == "steps":
        return ["--max-tokens-per-batch", str(base_step_tokens(base, name) // count)]
    if kind == "epochs":
        return ["--epochs", str(count * int(base.flag(TRAIN, "--epochs")))]
    return {"bs": ["--batch-size", str(count)], "ttt": ["--ttt-steps", str(count)]}[kind]


def format_changes(part: str, base: Base) -> dict[str, list[str]]:
    """A storage-format part: stage 02's format (bf16final: the base's own states) and larger steps."""
    extract = list(FORMATS[part])
    if "topk" in extract:
        extract += ["--target-topk", base.flag(EXTRACT, "--target-topk")]
    changes = {TRAIN: ["--max-tokens-per-batch", str(base.knobs.format_step_tokens)]}
    return {EXTRACT: extract, **changes} if extract else changes


def data_changes(part: str, base: Base, name: str) -> dict[str, list[str]]:
    """A data part: stage 01's flags (and stage 04's epochs for the data and all lanes)."""
    knobs = base.knobs
    made = MADE.fullmatch(part)
    if made:  # the base's exclusions alone: made turns are cached under them (a larger point's serve a smaller one)
        return {PREPARE: ["--synthesize", made_count(name, made.group(1)), *made_data(base, name),
                          *exclusions(base, base_heldout=False)]}
    exclude = exclusions(base)  # the base's held-out prompts stay out of a lane that takes more prompts
    if part == "sampled":
        return {PREPARE: ["--temperature", "0.8"]}
    if part == "mixed":
        return {PREPARE: ["--replies-per-prompt", "2", "--temperature", "0.8", "--greedy-first-reply"]}
    if part == "long":
        return {PREPARE: ["--max-new-tokens", str(knobs.long_tokens)]}
    if part == "turns2":
        turns2 = dataset_folder(base, name) / "sharegpt_turns2.json"
        return {PREPARE: ["--max-turns", "2", *exclude, "--dataset", str(turns2)]}
    turns = 1 if part == "data" else knobs.data_turns
    prepare = ["--max-turns", str(turns)] if part == "all" else []
    prepare += ["--num-samples", str(knobs.data_samples), *exclude]
    if turns > 1 or knobs.data_extra:  # other files than the base's: every file the lane reads
        files = all_values(base.flags.get(PREPARE, []), "--dataset") if turns == 1 else \
            [str(dataset_folder(base, name) / f"sharegpt_turns{turns}.json")]
        prepare += with_extra_files(base, name, files)
    return {PREPARE: prepare, TRAIN: ["--epochs", str(knobs.data_epochs)]}


def made_count(name: str, text: str) -> str:
    if int(text) < 1:
        raise UsageError(f"lane {name}: made{text} makes no conversation: give a count from 1, e.g. made35000")
    return str(int(text))


def made_data(base: Base, name: str) -> list[str]:
    """A made lane's chat files: the base's, and --data-extra beside them; the replies come from the verifier."""
    prepare = base.flags.get(PREPARE, [])
    if not has_flag(prepare, "--regenerate"):
        raise UsageError(f"lane {name}: conversations the verifier makes need its replies: give the base run's "
                         f"stage 01 --regenerate")
    return with_extra_files(base, name, all_values(prepare, "--dataset")) if base.knobs.data_extra else []


def first_part(part: str, base: Base, name: str) -> tuple[str, dict[str, list[str]]]:
    """A data or storage-format part: (the first stage it reruns, its changes per stage)."""
    aux = AUX.fullmatch(part)
    if (aux or part in FORMATS) and trains_online(base):
        raise UsageError(f"lane {name}: {part!r} changes stage 02's stored hidden states, and the base run trains "
                         f"--online (no stage 02): give a base without --online for the storage-format lanes")
    if aux:
        return EXTRACT, {EXTRACT: ["--aux-layers", ",".join(aux.groups())]}
    if part in FORMATS:
        changes = format_changes(part, base)
        return (EXTRACT if EXTRACT in changes else TRAIN), changes
    return PREPARE, data_changes(part, base, name)


# --- a whole name ------------------------------------------------------------------------------------

def lane_named(name: str, base: Base, suite: Sequence[str] = ()) -> Lane:
    """The lane a name means over `base`, with the benchmarks of `suite` it takes."""
    canonical = canonical_name(name)
    parts = canonical.split(JOIN)
    if not all(parts):
        raise UsageError(f"no lane called {name!r}: an empty part (two '_' in a row, or one at an end)")
    online = trains_online(base)
    if parts == ["specforge"]:  # its own trainer, with SpecForge's own learning rate
        if online:
            raise UsageError(f"lane {name}: SpecForge's recipe trains on stage 02's stored states, and the base run "
                             f"trains --online: give a base without --online for it")
        return Lane(canonical, {SPECFORGE: ["--lr", "1e-4"]}, TRAIN, takes(canonical, True, suite),
                    trainer=SPECFORGE, after=("default",))
    first_stage, changes, data = TRAIN, {}, ""
    if is_data_part(parts[0]):
        first_stage, changes = first_part(parts[0], base, canonical)
        data = parts[0] if first_stage < TRAIN else ""
    for part in parts[1:] if is_data_part(parts[0]) else parts:
        if is_data_part(part):
            raise UsageError(f"no lane called {name}: {part!r} is a data or storage-format part, which comes first "
                             f"(e.g. {part}_{parts[0]}); a name holds one")
        if part == "specforge":
            raise UsageError(f"no lane called {name}: specforge is SpecForge's own recipe and takes no other part")
        changes[TRAIN] = merged(changes.get(TRAIN, []), recipe_flags(part, base, canonical))
    sampled = parts[0] not in FORMATS  # the storage formats are compared at T=0 only
    return Lane(canonical, {stage: flags for stage, flags in changes.items() if flags}, first_stage,
                takes(canonical, sampled, suite, online), data, online=online,
                trains_on_base_heldout=MADE.fullmatch(parts[0]) is not None)


def takes(name: str, sampled: bool, suite: Sequence[str], online: bool = False) -> tuple[str, ...]:
    """The benchmarks of the suite a lane gets: T>0 runs only if `sampled`, the lossless checks on default only,
    none that reads stored states if it trains `online`."""
    return tuple(b for b in suite if (sampled or not BENCHMARKS[b].sampled)
                 and (name == "default" or not BENCHMARKS[b].default_only)
                 and not (online and BENCHMARKS[b].reads_states))


def describe_parts() -> str:
    """Every part and its meaning, for --help and error messages."""
    lines = ["Data and storage-format parts (first in a name):"]
    lines += [f"  {p.spelling:<10} {p.meaning}" for p in DATA_PARTS]
    lines += ["Recipe parts (stage 04; later ones win):"]
    lines += [f"  {p.spelling:<10} {p.meaning}" for p in RECIPE_PARTS]
    lines += [f"Aliases: {', '.join(f'{a} = {s}' for a, s in ALIASES.items())}"]
    return "\n".join(lines)
