"""Stage 04's checks before any heavy work: the inputs (hidden states, vocabulary map, verifier, a
--finetune-from drafter, --drafter-config), the output folder and --resume, disk space and the device."""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.formats.resume import setting_differences
from eagle3_pipeline.formats.manifest import MANIFEST, check_same, check_verifier_matches, load_manifest
from eagle3_pipeline.formats.files import read_json, sha256_file
from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.verifier.loading import (VerifierInfo, locate_embedding_tensors, locate_layer_tensors, pick_device,
                                              read_verifier_info)
from eagle3_pipeline.formats.layer_ids import check_aux_layers

STAGE = "04_train"
UPSTREAM_HIDDEN = "02_extract_hidden_states"
UPSTREAM_VOCAB = "03_build_vocab_mapping"
DEFAULT_TOKENS_PER_BATCH = 8192
UNLIMITED_SEQUENCES = 1 << 30
# Flags (and input hashes) a resumed run must share with the run it continues: they decide the split,
# the batch plan, the schedule and the loss, so changing one would not continue that run.
# The global batch counts, not --grad-accum: micro_batches_per_step = --grad-accum x ranks.
# --min-steps acts through max_sequences, which is compared, so a run saved before it resumes under its default.
RESUME_KEYS = ("seed", "epochs", "lr", "scheduler", "warmup_ratio", "micro_batches_per_step", "max_grad_norm",
               "max_seq_len", "ttt_steps", "ttt_decay", "ttt_positions", "loss", "noise_std", "val_ratio", "max_tokens",
               "max_sequences", "pad_batches_to", "finetune_from", "drafter_config",
               "init_from_verifier_layer", "compute_dtype", "hidden_states_index_sha256", "vocab_mapping_sha256",
               "prepared_data_sha256", "online_states")


@dataclass
class Inputs:
    data_dir: Path | None  # stage 02's folder; None for --online
    data_manifest: dict  # stage 02's manifest; for --online, the same description of the states computed here
    entries: list[dict]
    vocab_dir: Path
    vocab_manifest: dict
    mapping: object  # eagle3_pipeline.formats.vocab_map.VocabMapping
    verifier: VerifierInfo
    aux_layers: list[int]
    max_tokens: int
    max_sequences: int
    drafter_overrides: dict  # --drafter-config's DrafterConfig fields ({} when unset)
    pad_to: int  # batch lengths are rounded up to a multiple of this: --pad-batches-to, and FP8's alignment
    samples: list | None = None  # --online: stage 01's samples, whose states the verifier computes in training

    @property
    def online(self) -> bool:
        return self.samples is not None

    def dataset(self, entries: list[dict], max_seq_len: int):
        """The samples of `entries` as stage 04 reads them: stored states, or (--online) token ids alone."""
        if self.online:
            from eagle3_pipeline.train.online import PreparedDataset

            return PreparedDataset(self.samples, entries, max_seq_len)
        from eagle3_pipeline.train.data import HiddenStateDataset

        return HiddenStateDataset(self.data_dir, entries, max_seq_len)

    def split(self, val_ratio: float, seed: int, max_seq_len: int):
        """(training set, validation set): the seeded split of eagle3_pipeline.train.data.split_train_val."""
        from eagle3_pipeline.train.data import split_train_val

        train_pos, val_pos = split_train_val([str(entry["id"]) for entry in self.entries], val_ratio, seed)
        return (self.dataset([self.entries[i] for i in train_pos], max_seq_len),
                self.dataset([self.entries[i] for i in val_pos], max_seq_len))

    def drafter_config(self):
        """The shape of a new drafter: the verifier's, with --drafter-config's overrides."""
        from eagle3_pipeline.model.config import DrafterConfig

        return DrafterConfig.from_verifier(self.verifier, len(self.mapping.d2t), self.aux_layers,
                                           **self.drafter_overrides)


# --- input checks (all before anything heavy) ------------------------------------------------------------

def check_hidden_states(args) -> tuple[Path, dict, list[dict]]:
    from eagle3_pipeline.formats.hidden_states import open_hidden_states

    if not args.data_dir:
        raise UsageError("give --data-dir (stage 02's hidden_states folder) or --run-dir")
    data_dir = Path(args.data_dir)
    manifest, entries = open_hidden_states(data_dir)  # refuses a missing, foreign or unfinished folder
    expected = (manifest.get("counts") or {}).get("samples")
    if expected is not None and len(entries) != int(expected):
        raise UsageError(f"--data-dir {data_dir}: the index lists {len(entries)} samples but {MANIFEST} counts "
                         f"{expected}; rerun {UPSTREAM_HIDDEN}.py, which completes what is missing")
    missing = [entry["path"] for entry in entries if not (data_dir / entry["path"]).is_dir()]
    if missing:
        raise UsageError(f"--data-dir {data_dir}: {len(missing)} indexed sample folders are missing (first: "
                         f"{', '.join(missing[:3])}); rerun {UPSTREAM_HIDDEN}.py, which redoes missing samples")
    # Samples without a loss token teach nothing (and would only cost reading them).
    entries = [entry for entry in entries if int(entry.get("loss_tokens", 1)) > 0]
    if not entries:
        raise UsageError(f"--data-dir {data_dir}: the index lists no complete sample with loss tokens; rerun "
                         f"{UPSTREAM_HIDDEN}.py on data with assistant turns")
    for key in ("aux_layers", "hidden_size"):
        if key not in manifest:
            raise UsageError(f"{data_dir / MANIFEST} records no {key!r}; rerun {UPSTREAM_HIDDEN}.py")
    return data_dir, manifest, entries


def check_states_flags(args, data_dir: Path, data_manifest: dict) -> None:
    """Offline, the states' layers and format come from stage 02: --aux-layers, --aux-dtype and --targets (for
    --online runs) may only repeat what the hidden states hold."""
    from eagle3_pipeline.formats.storage import format_of_manifest

    stored = format_of_manifest(data_manifest, f"--data-dir {data_dir}")
    asked = []
    if args.aux_layers and list(args.aux_layers) != list(data_manifest.get("aux_layers") or []):
        asked.append(f"--aux-layers {','.join(map(str, args.aux_layers))} (they hold layers "
                     f"{data_manifest.get('aux_layers')})")
    if args.aux_dtype == "float8_e4m3" and not stored.fp8:
        asked.append(f"--aux-dtype float8_e4m3 (they hold aux in {stored.aux_dtype})")
    if args.targets == "topk" and (stored.targets != "topk" or stored.topk != args.target_topk):
        asked.append(f"--targets topk --target-topk {args.target_topk} (they hold {stored.key().split(', ')[1]} "
                     f"targets)")
    if asked:
        raise UsageError(f"--data-dir {data_dir}: {'; '.join(asked)}. Offline, stage 04 trains on the states stage 02 "
                         f"stored: drop these flags, extract again with them, or pass --online to compute the states "
                         f"in training")


def check_vocab(args, data_name: str, data_manifest: dict):
    from eagle3_pipeline.formats.checkpoint import vocab_mapping_problems
    from eagle3_pipeline.formats.vocab_map import load_mapping

    if not args.vocab_mapping_dir:
        raise UsageError("give --vocab-mapping-dir (stage 03's vocab folder) or --run-dir")
    vocab_dir = Path(args.vocab_mapping_dir)
    manifest = load_manifest(vocab_dir, UPSTREAM_VOCAB, "--vocab-mapping-dir")
    vocab_name = str(vocab_dir / MANIFEST)
    check_verifier_matches(data_manifest, data_name, manifest.get("verifier", {}), vocab_name)
    check_same_prepared_data(data_manifest, data_name, manifest, vocab_name)
    mapping = load_mapping(vocab_dir)
    vocab_size = int((data_manifest.get("verifier") or {}).get("vocab_size") or len(mapping.t2d))
    draft_vocab_size = int(manifest.get("draft_vocab_size") or len(mapping.d2t))
    # The file must be what the manifest describes (a map replaced after the fact is stale too).
    problems = vocab_mapping_problems(mapping.d2t, mapping.t2d, draft_vocab_size, vocab_size)
    if problems:
        raise UsageError(f"{vocab_dir}: the vocabulary map does not match its manifest or the hidden states: "
                         f"{'; '.join(problems)}. Rerun {UPSTREAM_VOCAB}.py --overwrite")
    return vocab_dir, manifest, mapping


def check_same_prepared_data(data_manifest: dict, data_name: str, vocab_manifest: dict, vocab_name: str) -> None:
    """A vocabulary map built from other prepared data than the hidden states is stale: refuse it."""
    ours = data_manifest.get("inputs", {}).get("prepared_data", {})
    theirs = vocab_manifest.get("inputs", {}).get("prepared_data", {})
    if not ours.get("manifest_sha256") or not theirs.get("manifest_sha256"):
        from eagle3_pipeline.log import get_logger

        get_logger().warning("cannot tell whether %s and %s come from the same prepared data (no "
                             "inputs.prepared_data.manifest_sha256 recorded)", data_name, vocab_name)
        return
    if ours["manifest_sha256"] != theirs["manifest_sha256"]:
        raise UsageError(
            f"stale vocabulary map: {vocab_name} was built from the prepared data {theirs.get('path')} "
            f"(its manifest sha256 {theirs['manifest_sha256'][:16]}...), but the hidden states {data_name} come "
            f"from {ours.get('path')} (manifest sha256 {ours['manifest_sha256'][:16]}...). Rebuild the map from "
            f"the same data: 03_build_vocab_mapping.py --prepared-data {ours.get('path')} --overwrite "
            f"(or point --vocab-mapping-dir at the map of that data)")


def check_verifier(args, name: str, data_manifest: dict) -> tuple[VerifierInfo, list[int]]:
    """--model-path (default: the verifier the hidden states record) must be the verifier of the data (`name`:
    where the data's description is, for messages)."""
    recorded = data_manifest.get("verifier", {})
    model_path = args.model_path or recorded.get("path")
    if not model_path:
        raise UsageError(f"give --model-path (the verifier); {name} records none")
    args.model_path = model_path
    info = read_verifier_info(model_path, args.trust_remote_code)
    check_verifier_matches(data_manifest, name, info.identity(), f"--model-path {model_path}")
    fix = f"Use the verifier the hidden states were extracted from ({recorded.get('path')})."
    check_same("hidden_size", data_manifest.get("hidden_size"), name, info.hidden_size, f"--model-path {model_path}", fix)
    check_same("num_layers", recorded.get("num_layers"), name, info.num_layers, f"--model-path {model_path}", fix)
    try:
        aux_layers = check_aux_layers(list(data_manifest["aux_layers"]), info.num_layers)
    except UsageError as err:
        raise UsageError(f"{name}: {err}")
    from eagle3_pipeline.formats.layer_ids import eagle_config_layer_ids

    try:  # a drafter SGLang could never feed (vLLM can): say so before training it
        eagle_config_layer_ids(aux_layers, info.architecture)
    except ValueError as err:
        logging.getLogger(STAGE).warning("%s: %s; vLLM can serve this drafter, SGLang cannot (rerun "
                                         "02_extract_hidden_states.py with other --aux-layers for SGLang)", name, err)
    if not args.online:  # (online, the states come from these very weights)
        from eagle3_pipeline.verifier.fingerprint import check_same_weights

        check_same_weights(data_manifest.get("verifier_weights"), recorded.get("path"), model_path,
                           args.allow_other_verifier, f"--data-dir {args.data_dir}", logging.getLogger("eagle3"))
    locate_embedding_tensors(model_path)  # safetensors index/headers only: the tensors are read later
    return info, aux_layers


def check_drafter_config(args, info: VerifierInfo, mapping, aux_layers: list[int]) -> dict:
    """--drafter-config (a JSON object or file of DrafterConfig fields) parsed, and tried on the verifier's shape."""
    from eagle3_pipeline.model.config import DrafterConfig, parse_drafter_overrides

    try:
        overrides = parse_drafter_overrides(args.drafter_config)
    except ValueError as err:
        raise UsageError(str(err))
    try:
        DrafterConfig.from_verifier(info, len(mapping.d2t), aux_layers, **overrides)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--drafter-config {args.drafter_config}: {err}")
    return overrides


def check_finetune(args, data_manifest: dict, info: VerifierInfo, mapping, overrides: dict) -> None:
    """A --finetune-from drafter must fit the data and keeps its own shape: --drafter-config may only repeat it."""
    if not args.finetune_from:
        return
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.checkpoint import check_drafter_dir

    folder = Path(args.finetune_from)
    if not (folder / "config.json").exists():
        raise UsageError(f"--finetune-from {folder}: no config.json there; give an EAGLE-3 drafter folder")
    problems = list(check_drafter_dir(folder, data_manifest=data_manifest, verifier_info=info))
    try:
        config = DrafterConfig.from_sglang_config(read_json(folder / "config.json"))
    except (ValueError, TypeError, KeyError) as err:
        raise UsageError(f"--finetune-from {folder}: config.json is not an EAGLE-3 drafter config ({err})")
    if config.draft_vocab_size != len(mapping.d2t):
        problems.append(f"its draft_vocab_size is {config.draft_vocab_size} but the vocabulary map "
                        f"{args.vocab_mapping_dir} has {len(mapping.d2t)} (rebuild the map with "
                        f"--draft-vocab-size {config.draft_vocab_size})")
    for key, value in overrides.items():
        if getattr(config, key) != value:
            problems.append(f"--drafter-config sets {key} to {value!r} but this drafter has {getattr(config, key)!r} "
                            f"(a fine-tuned drafter keeps its own shape: drop --drafter-config)")
    if problems:
        raise UsageError(f"--finetune-from {folder} does not fit this run:\n  " + "\n  ".join(problems))


def check_layer_init(args, info: VerifierInfo, mapping, aux_layers: list[int], overrides: dict) -> None:
    """--init-from-verifier-layer: a new drafter (not --finetune-from) whose layer has the verifier's last layer's
    shape, checked on the safetensors headers before anything heavy starts."""
    if not args.init_from_verifier_layer:
        return
    if args.finetune_from:
        raise UsageError("--init-from-verifier-layer starts a new drafter and --finetune-from continues one: "
                         "give one of them")
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.layer_init import layer_shape_problems

    layer = info.num_layers - 1
    found = locate_layer_tensors(args.model_path, layer)
    config = DrafterConfig.from_verifier(info, len(mapping.d2t), aux_layers, **overrides)
    problems = layer_shape_problems(config, {role: shape for role, (_, _, shape) in found.items()})
    if problems:
        raise UsageError(f"--init-from-verifier-layer: layer {layer} of {args.model_path} does not fit the drafter "
                         f"({'; '.join(problems)}); drop the flag or the --drafter-config that changes the shape")


def resolve_machine_defaults(args):
    """--pad-batches-to when not given, resolved for this machine's device before the run records its flags: the
    stage and run_pipeline.py's staleness check (which parses through the stage's own parse) then see one value."""
    if args.pad_batches_to is None:
        try:
            args.pad_batches_to = default_pad_batches_to(pick_device(args.device))
        except UsageError:  # no such device here: check_inputs says so, as an input error
            pass
    return args


def default_pad_batches_to(device: str) -> int:
    """--pad-batches-to when not given: on a GPU, repeating shapes spare the host per-shape work; a CPU has none."""
    return 64 if str(device).startswith("cuda") else 1


def resolve_batching(args, entries: list[dict], multiple: int) -> tuple[int, int]:
    """(max padded tokens, max sequences) per micro-batch, from --max-tokens-per-batch and --batch-size; a
    sample counts as its length rounded up to `multiple`, as it is padded."""
    from eagle3_pipeline.train.data import round_up

    padded_seq_len = round_up(args.max_seq_len, multiple)
    max_sequences = args.batch_size or UNLIMITED_SEQUENCES
    if args.max_tokens_per_batch:
        max_tokens = args.max_tokens_per_batch
    elif args.batch_size:
        max_tokens = args.batch_size * padded_seq_len
    else:
        max_tokens = max(DEFAULT_TOKENS_PER_BATCH, padded_seq_len)
    longest = max(min(int(e["num_tokens"]), args.max_seq_len) for e in entries)
    padded_longest = round_up(longest, multiple)
    if padded_longest > max_tokens:
        padded = (f", {padded_longest} padded to a multiple of {multiple} (--pad-batches-to"
                  f"{', --fp8' if args.fp8 else ''})" if multiple > 1 else "")
        raise UsageError(f"--max-tokens-per-batch {max_tokens} is below the longest sample ({longest} tokens after "
                         f"--max-seq-len {args.max_seq_len}{padded}): raise it, or lower --max-seq-len"
                         f"{' or --pad-batches-to' if multiple > 1 else ''}")
    return max_tokens, max_sequences


def check_inputs(args, log) -> Inputs:
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: give one")
    samples = None
    if args.online:
        from eagle3_pipeline.train.online import check_online_source

        data_dir = None
        data_manifest, entries, samples, name = check_online_source(args, log)
    else:
        data_dir, data_manifest, entries = check_hidden_states(args)
        check_states_flags(args, data_dir, data_manifest)
        name = str(data_dir / MANIFEST)
    vocab_dir, vocab_manifest, mapping = check_vocab(args, name, data_manifest)
    info, aux_layers = check_verifier(args, name, data_manifest)
    overrides = check_drafter_config(args, info, mapping, aux_layers)
    check_finetune(args, data_manifest, info, mapping, overrides)
    check_layer_init(args, info, mapping, aux_layers, overrides)
    from eagle3_pipeline.train.data import batch_length_multiple

    device = pick_device(args.device)  # a missing GPU is an input error, found now
    args.pad_batches_to = args.pad_batches_to or default_pad_batches_to(device)  # recorded with the run
    pad_to = batch_length_multiple(args.pad_batches_to, args.fp8)
    max_tokens, max_sequences = resolve_batching(args, entries, pad_to)
    if device.startswith("cuda") and args.dtype == "float16":
        raise UsageError("--dtype float16: stage 04 trains in bfloat16 (or float32); float16 would need loss "
                         "scaling. Use --dtype bfloat16")
    if not device.startswith("cuda") and args.dtype == "float16":  # as stage 02 says: computed in float32 on CPU
        log.warning("--dtype float16: stage 04 trains in bfloat16 or float32 (float16 is refused on a GPU); on %s "
                    "the drafter trains in float32", device)
    log.info("inputs: %d %s samples (%s, aux layers %s), draft vocabulary %d of %d, verifier %s", len(entries),
             "prepared (--online: states computed in training)" if args.online else "hidden-state",
             args.prepared_data if args.online else data_dir, aux_layers, len(mapping.d2t), len(mapping.t2d), info.path)
    return Inputs(data_dir, data_manifest, entries, vocab_dir, vocab_manifest, mapping, info, aux_layers,
                  max_tokens, max_sequences, overrides, pad_to, samples)


def apply_min_steps(args, inputs: Inputs, world_size: int, log) -> None:
    """--min-steps: cap the sequences of a micro-batch (inputs.max_sequences) when the plan gives too few steps."""
    from eagle3_pipeline.train.data import sequences_for_min_steps

    if not args.min_steps:
        return
    train_set, _ = inputs.split(args.val_ratio, args.seed, args.max_seq_len)
    capped = sequences_for_min_steps(train_set.lengths(), inputs.max_tokens, inputs.max_sequences, args.epochs,
                                     args.grad_accum * world_size, args.min_steps, args.seed, inputs.pad_to)
    if capped != inputs.max_sequences:
        log.info("--min-steps %d: the batch plan gives fewer optimizer steps, so a micro-batch holds at most %d "
                 "sequence(s)", args.min_steps, capped)
        inputs.max_sequences = capped


def run_config_of(args, inputs: Inputs, world_size: int = 1) -> dict:
    from eagle3_pipeline.train.parameters import compute_dtype_for

    flags = ("seed", "epochs", "lr", "scheduler", "warmup_ratio", "grad_accum", "max_grad_norm", "max_seq_len",
             "ttt_steps", "ttt_decay", "ttt_positions", "loss", "noise_std", "val_ratio", "pad_batches_to",
             "min_steps")
    return {
        **{key: getattr(args, key) for key in flags},
        "world_size": world_size, "micro_batches_per_step": args.grad_accum * world_size,
        "max_tokens": inputs.max_tokens, "max_sequences": inputs.max_sequences,
        "finetune_from": str(Path(args.finetune_from).resolve()) if args.finetune_from else None,
        "drafter_config": inputs.drafter_overrides,
        "init_from_verifier_layer": bool(args.init_from_verifier_layer),
        "compute_dtype": compute_dtype_for(pick_device(args.device), args.dtype),
        **states_identity(args, inputs),
        "vocab_mapping_sha256": sha256_file(inputs.vocab_dir / "vocab_mapping.safetensors"),
    }


def states_identity(args, inputs: Inputs) -> dict:
    """What decides the states trained on, for --resume: stage 02's index, or (--online) the prepared data and how
    the states are computed from it."""
    if not inputs.online:
        return {"hidden_states_index_sha256": sha256_file(_index_path(inputs.data_dir, inputs.data_manifest))}
    states = inputs.data_manifest
    return {"prepared_data_sha256": sha256_file(args.prepared_data),
            "online_states": {key: states.get(key) for key in ("aux_layers", "dtype", "compute_dtype", "storage",
                                                               "verifier_weights")}}


def _index_path(data_dir: Path, data_manifest: dict) -> Path:
    return data_dir / data_manifest.get("index", "index.jsonl")


def check_output(args, run_config: dict, log) -> tuple[Path | None, bool]:
    """(checkpoint to resume from or None, whether earlier outputs must be cleared before starting).
    Refuses to mix two runs in one folder; --resume takes the newest whole checkpoint. First removes what a failed
    or killed save left half-written."""
    from eagle3_pipeline.train.checkpoints import TRAINER_STATE_JSON, CheckpointManager

    output_dir = Path(args.output_dir)
    manager = CheckpointManager(output_dir, args.keep_last)
    remove_staging_leftovers(manager, log)
    if args.overwrite:
        return None, manager.has_outputs()
    if not args.resume:
        if manager.has_outputs():
            latest = manager.pointer_target("latest")
            raise UsageError(f"--output-dir {output_dir} already holds checkpoints of a run"
                             f"{f' (latest: {latest})' if latest else ''}: pass --resume to continue it, "
                             f"--overwrite to delete them and start over, or choose another --output-dir")
        return None, False
    point = manager.resume_point(log)
    if point is None:
        # A run that stopped before its first checkpoint: start it again, without its stray metrics.
        log.warning("--resume: no complete checkpoint in %s; starting from the beginning", output_dir)
        return None, manager.has_outputs()
    previous = read_json(point / TRAINER_STATE_JSON).get("run_config", {})
    if "micro_batches_per_step" not in previous and "grad_accum" in previous:  # saved before torchrun: 1 process
        previous = {**previous, "micro_batches_per_step": previous["grad_accum"]}
    if "ttt_steps" in previous and "ttt_positions" not in previous:  # saved before --ttt-positions: fixed ones
        previous = {**previous, "ttt_positions": "fixed"}
    if "ttt_steps" in previous and "loss" not in previous:  # saved before --loss: the soft-CE
        previous = {**previous, "loss": "kl"}
    if "ttt_steps" in previous and "pad_batches_to" not in previous:  # saved before --pad-batches-to: unpadded
        previous = {**previous, "pad_batches_to": 1}
    changed = setting_differences(previous, run_config, [key for key in RESUME_KEYS if key in previous])
    if any(line.startswith("micro_batches_per_step") for line in changed):
        changed.append(f"(micro_batches_per_step = --grad-accum x ranks; the run being resumed had --grad-accum "
                       f"{previous.get('grad_accum')} on {previous.get('world_size', 1)} rank(s): on "
                       f"{run_config['world_size']} rank(s) give --grad-accum "
                       f"{previous['micro_batches_per_step'] / run_config['world_size']:g})")
    if any(line.startswith("max_sequences") for line in changed):
        changed.append(f"(--min-steps caps max_sequences when the plan gives fewer steps than it: give the run's "
                       f"--min-steps, {previous.get('min_steps', '0, as it was saved before the flag')})")
    if changed:
        raise UsageError(f"--resume from {point}: these settings or inputs differ from the run being resumed, "
                         f"so it could not continue exactly:\n  " + "\n  ".join(changed) +
                         "\nRerun with the original values, or start over with --overwrite (or another --output-dir)")
    return point, False


def remove_staging_leftovers(manager, log) -> None:
    """The staging folders of saves that never finished (`.step_N.tmp-PID`, as large as a checkpoint), on the main
    process only: it holds the folder's lock, so no save of a live run is among them."""
    from eagle3_pipeline.distributed import rank_info

    if not rank_info().is_main:
        return
    removed = manager.remove_staging_leftovers()
    if removed:
        log.warning("removed what earlier checkpoint saves left half-written in %s: %s", manager.root,
                    ", ".join(sorted(removed)))


def check_disk(args, model_params: int, log) -> None:
    """Every kept checkpoint holds the weights and AdamW's fp32 moments (and fp32 master weights for bf16):
    at most 16 bytes a trainable parameter."""
    output_dir = Path(args.output_dir)
    per_checkpoint = model_params * 16
    kept = args.keep_last + args.epochs + 1
    need = per_checkpoint * kept
    free = shutil.disk_usage(output_dir).free
    if free < need:
        message = (f"{output_dir}: {free / 1e9:.1f} GB free, but up to {kept} checkpoints of about "
                   f"{per_checkpoint / 1e9:.2f} GB each may be kept ({need / 1e9:.1f} GB): free space, lower "
                   f"--keep-last, or pass --allow-low-disk")
        if not args.allow_low_disk:
            raise UsageError(message)
        log.warning(message)




def rank_device(args, rank) -> str:
    """This process's device: under torchrun on GPUs, cuda:LOCAL_RANK (one GPU a rank)."""
    device = pick_device(args.device)
    if not (rank.distributed and device.startswith("cuda")):
        return device
    import torch

    if torch.cuda.device_count() < rank.local_world_size:
        raise UsageError(f"{rank.local_world_size} processes on this node but {torch.cuda.device_count()} visible "
                         f"GPU(s): stage 04 runs one process a GPU (torchrun --nproc_per_node)")
    return f"cuda:{rank.local_rank}"


def check_fp8(args, device: str) -> None:
    if not args.fp8:
        return
    import torch
    from eagle3_pipeline.model.kernels import fp8_available

    if not fp8_available(torch.device(device)):
        raise UsageError(f"--fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell), "
                         f"and {device} has none: drop --fp8")

