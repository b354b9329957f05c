"""A drafter folder as a model: saving one atomically, loading one (ours or a published LlamaForCausalLMEagle3
one), and every check a server needs of it, on top of the file contract in eagle3_pipeline/formats/checkpoint.py."""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import Tensor

from eagle3_pipeline.formats.checkpoint import (ARCHITECTURE, CONFIG_FILE, FORBIDDEN_CONFIG_KEYS, METADATA_KEY,
                                                WEIGHTS_FILE, check_drafter_readable, expected_tensor_specs,
                                                vocab_mapping_problems)
from eagle3_pipeline.formats.files import readable_like_any_file
from eagle3_pipeline.formats.layer_ids import (LAYER_CONVENTION, aux_layers_from_eagle_config, eagle_config_layer_ids,
                                               server_default_layers)
from eagle3_pipeline.model.config import DrafterConfig, rope_parameters
from eagle3_pipeline.model.drafter import Eagle3Drafter


def drafter_state_dict(model: Eagle3Drafter) -> dict[str, Tensor]:
    """The exported tensors (no embed_tokens), contiguous, on the CPU."""
    state = model.state_dict()
    return {name: state[name].detach().to("cpu").contiguous() for name in expected_tensor_specs(model.config)}


def save_drafter(model: Eagle3Drafter, directory, extra: dict | None = None) -> None:
    """Write an SGLang-ready drafter folder atomically: config.json + model.safetensors.

    The folder is built under a temporary name beside `directory` and renamed into place, so a crash
    never leaves a half-written checkpoint under the final name. `extra` is recorded in config.json under
    "eagle3_pipeline" (ignored by the servers).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    config = cfg.to_sglang_config()
    config["torch_dtype"] = str(model.compute_dtype).replace("torch.", "")
    meta = {"aux_layers": list(cfg.aux_layers), "layer_convention": LAYER_CONVENTION,
            "verifier_architecture": cfg.verifier_architecture,
            "sglang_eagle_config_ids": config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")}
    meta.update(extra or {})
    config[METADATA_KEY] = meta
    staging = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(drafter_state_dict(model), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        readable_like_any_file(staging / WEIGHTS_FILE)  # save_file makes 0600
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n")
        old = None
        if directory.exists() or directory.is_symlink():
            old = directory.with_name(f".{directory.name}.old{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(staging, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_drafter(directory, embed: Tensor | None = None, device="cpu", dtype=torch.float32) -> Eagle3Drafter:
    """Load a drafter folder (ours or a published LlamaForCausalLMEagle3 one).

    `embed` is the verifier's embedding (eagle3_pipeline.verifier.loading.read_embedding_tensors); a checkpoint's own
    embed_tokens.weight wins when present. Without either the embedding stays zero (and a warning says so).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    check_drafter_readable(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    cfg = DrafterConfig.from_sglang_config(config)
    tensors = load_file(str(directory / WEIGHTS_FILE))
    tensors = {_canonical_key(k): v for k, v in tensors.items()}
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    model = model.to_empty(device="cpu")
    model.inv_freq.copy_(rope_parameters(cfg)[0])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.midlayer.mlp.recompute = "act"
        state = {k: v for k, v in tensors.items() if k in expected_tensor_specs(cfg)}
        missing = [k for k in expected_tensor_specs(cfg) if k not in state and k not in ("d2t", "t2d")]
        if missing:
            raise ValueError(f"{directory / WEIGHTS_FILE}: missing tensors {missing}")
        if "d2t" not in state:  # drafters over the full vocabulary have no map
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
            state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        model.load_state_dict(state, strict=False)
        own_embed = tensors.get("embed_tokens.weight")
        source = own_embed if own_embed is not None else embed
        if source is not None:
            model.embed_tokens.weight.copy_(source)
        else:
            warnings.warn(f"{directory}: no embed_tokens in the checkpoint and no verifier embedding given; "
                          "the drafter's embedding is zero")
    model.embed_tokens.weight.requires_grad_(False)
    float_dtype = dtype
    model = model.to(device=device)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            param.data = param.data.to(float_dtype)
    return model


def _canonical_key(name: str) -> str:
    """Published drafters sometimes prefix keys with model. or use layers.0 (vLLM naming)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def check_drafter_dir(directory, data_manifest: dict | None = None, verifier_info=None) -> list[str]:
    """Every problem that would stop SGLang from loading this drafter correctly (empty = valid)."""
    return inspect_drafter_dir(directory, data_manifest, verifier_info)[0]


def inspect_drafter_dir(directory, data_manifest: dict | None = None, verifier_info=None,
                        for_vllm: bool = False) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a drafter folder: files, config fields, tensor keys/shapes/dtypes,
    vocabulary map, layer ids against the hidden-state manifest, sizes against the verifier. With `for_vllm`,
    vLLM capturing other layers than the stored ones is a problem (the drafter is to be served), not a warning
    (a drafter only fine-tuned from is exported again with the right ids)."""
    directory = Path(directory)
    notes: list[str] = []
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    config, problems = _read_config(directory, config_path, weights_path)
    if config is None:
        return problems, notes
    sglang_ids = _config_field_problems(config, config_path, problems)
    if problems:
        return problems, notes
    try:
        cfg = DrafterConfig.from_sglang_config(config)
    except (ValueError, TypeError) as err:
        return [f"{config_path}: {err}"], notes
    sglang_layers = _check_layer_ids(config, config_path, cfg, sglang_ids, data_manifest, verifier_info,
                                     problems, notes, problems if for_vllm else notes)
    _check_sizes(cfg, config_path, sglang_layers, data_manifest, verifier_info, problems)
    _check_tensors(cfg, weights_path, problems, notes)
    return problems, notes


def _read_config(directory: Path, config_path: Path, weights_path: Path) -> tuple[dict | None, list[str]]:
    """(config.json's content, []) or (None, the problems) when the folder, a file or the JSON is missing."""
    if not directory.is_dir():
        return None, [f"{directory}: no such folder"]
    problems = [f"{path}: missing" for path in (config_path, weights_path) if not path.is_file()]
    if problems:
        return None, problems
    try:
        return json.loads(config_path.read_text(encoding="utf-8")), []
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, [f"{config_path}: not valid JSON ({err})"]


def _config_field_problems(config: dict, config_path: Path, problems: list[str]) -> list[int] | None:
    """Append what SGLang's LlamaForCausalLMEagle3 needs of config.json; returns the valid eagle_config ids."""
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"{config_path}: architectures is {config.get('architectures')!r}, expected "
                        f"[{ARCHITECTURE!r}]")
    if config.get("model_type") != "llama":
        problems.append(f"{config_path}: model_type is {config.get('model_type')!r}, expected 'llama'")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"{config_path}: num_hidden_layers is {config.get('num_hidden_layers')!r}, expected 1")
    if config.get("tie_word_embeddings") is not False:
        problems.append(f"{config_path}: tie_word_embeddings must be false")
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "rms_norm_eps", "vocab_size", "draft_vocab_size", "max_position_embeddings"):
        if key not in config:
            problems.append(f"{config_path}: missing {key}")
    if "rope_theta" not in config and "rope_parameters" not in config:
        problems.append(f"{config_path}: missing rope_theta")
    for key in FORBIDDEN_CONFIG_KEYS:
        if key in config:
            problems.append(f"{config_path}: has EAGLE-3.1 flag {key!r}; remove it")
    eagle = config.get("eagle_config")
    if not isinstance(eagle, dict):
        problems.append(f"{config_path}: missing eagle_config")
        return None
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append(f"{config_path}: eagle_config.use_aux_hidden_state must be true")
    sglang_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if sglang_ids is not None and (not isinstance(sglang_ids, list) or len(sglang_ids) != 3
                                   or not all(isinstance(x, int) for x in sglang_ids)):
        problems.append(f"{config_path}: eagle_config.eagle_aux_hidden_state_layer_ids must be three "
                        f"integers, got {sglang_ids!r}")
        return None
    return sglang_ids


def _check_layer_ids(config: dict, config_path: Path, cfg: DrafterConfig, sglang_ids: list[int] | None,
                     data_manifest: dict | None, verifier_info, problems: list[str],
                     notes: list[str], vllm_mismatch: list[str]) -> list[int] | None:
    """Append what each server will capture (HF output_hidden_states indices) against the stored layers (vLLM
    capturing other layers goes to `vllm_mismatch`); returns the layers SGLang captures (None without
    eagle_config ids)."""
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    # SGLang's id rule depends on the verifier's architecture: the verifier's own, else the one recorded.
    architecture = (getattr(verifier_info, "architecture", None)
                    or ((data_manifest or {}).get("verifier") or {}).get("architecture")
                    or cfg.verifier_architecture)
    sglang_layers = aux_layers_from_eagle_config(sglang_ids, architecture) if sglang_ids else None
    stored = (data_manifest or {}).get("aux_layers")
    if stored is not None:
        stored = [int(x) for x in stored]
        num_layers = ((data_manifest or {}).get("verifier") or {}).get("num_layers")
        default = server_default_layers(num_layers) if num_layers else None
        sglang_effective = sglang_layers if sglang_layers is not None else default
        vllm_effective = list(vllm_ids) if vllm_ids else (
            list(config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")) if sglang_ids else default)
        if sglang_effective != stored:
            mismatch = (f"{config_path}: SGLang will capture the inputs of layers {sglang_effective} (eagle_config "
                        f"ids {sglang_ids} on {architecture or 'a Llama-style verifier'}) but the hidden states were "
                        f"stored for layers {stored}")
            try:
                problems.append(f"{mismatch}; eagle_config.eagle_aux_hidden_state_layer_ids must be "
                                f"{eagle_config_layer_ids(stored, architecture)}")
            except ValueError as err:  # nothing to fix in this folder: only vLLM can serve such a drafter
                notes.append(f"{mismatch}: {err}")
        if vllm_effective != stored:
            vllm_mismatch.append(f"{config_path}: vLLM would capture the inputs of layers {vllm_effective}, not the "
                         f"stored {stored}; set the top-level eagle_aux_hidden_state_layer_ids to {stored}")
    elif sglang_layers is not None and vllm_ids and list(vllm_ids) != sglang_layers:
        problems.append(f"{config_path}: SGLang captures layers {sglang_layers} but the top-level (vLLM) ids "
                        f"say {list(vllm_ids)}; they must name the same layers")
    elif sglang_layers is not None and not vllm_ids:
        notes.append(f"{config_path}: no top-level eagle_aux_hidden_state_layer_ids: vLLM would read the "
                     f"eagle_config ids {sglang_ids} as layer inputs (one layer earlier than SGLang)")
    if sglang_ids and min(sglang_ids) < 0:
        notes.append(f"{config_path}: eagle_config id {min(sglang_ids)} < 0 (captures the embeddings)")
    return sglang_layers


def _check_sizes(cfg: DrafterConfig, config_path: Path, sglang_layers: list[int] | None,
                 data_manifest: dict | None, verifier_info, problems: list[str]) -> None:
    """Append size mismatches against the verifier and the hidden states."""
    if verifier_info is not None:
        if cfg.vocab_size != verifier_info.vocab_size:
            problems.append(f"{config_path}: vocab_size {cfg.vocab_size} != verifier's {verifier_info.vocab_size}")
        target_h = cfg.target_hidden_size or cfg.hidden_size
        if target_h != verifier_info.hidden_size:
            problems.append(f"{config_path}: hidden size {target_h} != verifier's {verifier_info.hidden_size}")
        num_layers = verifier_info.num_layers
        for layer in (sglang_layers or []):
            if not 0 <= layer < num_layers:
                problems.append(f"{config_path}: captured layer {layer} outside the verifier's 0..{num_layers - 1}")
    manifest_verifier = (data_manifest or {}).get("verifier") or {}
    if manifest_verifier.get("hidden_size") and manifest_verifier["hidden_size"] != (cfg.target_hidden_size or cfg.hidden_size):
        problems.append(f"{config_path}: hidden size {cfg.hidden_size} != the hidden states' "
                        f"{manifest_verifier['hidden_size']}")


def _check_tensors(cfg: DrafterConfig, weights_path: Path, problems: list[str], notes: list[str]) -> None:
    """Append what is wrong with the safetensors file: keys, shapes, dtypes and the vocabulary map."""
    from safetensors import safe_open

    specs = expected_tensor_specs(cfg)
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            names = set(handle.keys())
            tensors_meta = {}
            for name in names:
                sl = handle.get_slice(name)
                tensors_meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
            d2t = handle.get_tensor("d2t") if "d2t" in names else None
            t2d = handle.get_tensor("t2d") if "t2d" in names else None
    except Exception as err:  # noqa: BLE001 - a corrupt file is a problem to report
        problems.append(f"{weights_path}: cannot read ({err})")
        return
    for name in sorted(set(specs) - names):
        problems.append(f"{weights_path}: missing tensor {name!r}")
    for name in sorted(names - set(specs)):
        if name == "embed_tokens.weight":
            notes.append(f"{weights_path}: has embed_tokens.weight (SGLang uses the verifier's embedding)")
        else:
            problems.append(f"{weights_path}: unexpected tensor {name!r} (SGLang would silently skip it)")
    float_dtypes = set()
    for name, (shape, kind) in specs.items():
        if name not in tensors_meta:
            continue
        got_shape, got_dtype = tensors_meta[name]
        if got_shape != shape:
            problems.append(f"{weights_path}: {name} has shape {list(got_shape)}, expected {list(shape)}")
        expected_dtype = {"int64": "I64", "bool": "BOOL"}.get(kind)
        if expected_dtype and got_dtype != expected_dtype:
            problems.append(f"{weights_path}: {name} has dtype {got_dtype}, expected {expected_dtype}")
        if kind == "float":
            if got_dtype not in ("BF16", "F16", "F32"):
                problems.append(f"{weights_path}: {name} has dtype {got_dtype}, expected a float dtype")
            float_dtypes.add(got_dtype)
    if len(float_dtypes) > 1:
        problems.append(f"{weights_path}: mixed float dtypes {sorted(float_dtypes)}")
    if d2t is not None and t2d is not None and tensors_meta["d2t"][1] == "I64" and tensors_meta["t2d"][1] == "BOOL":
        problems += [f"{weights_path}: {p}" for p in
                     vocab_mapping_problems(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size)]
