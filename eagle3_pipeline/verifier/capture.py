"""The one capture rule of the aux hidden states: which residual stream is kept (the input of decoder layer l =
transformers' output_hidden_states[l]), the text model it is taken from, and the hook that takes it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

_LAYER_LISTS = ("layers", "h", "blocks", "block")
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")
_NOT_TEXT = ("vision", "visual", "audio", "image", "mm_projector", "multi_modal_projector", "speech")


def capture_layer_ids(aux_layers: Sequence[int]) -> list[int]:
    """The decoder layers whose INPUT is captured for `aux_layers` (HF output_hidden_states indices).

    The input of decoder layer l is output_hidden_states[l] (index 0 = the embedding output), so the ids map to
    themselves, with no +1 shift; they must be distinct and ascending (aux_0 < aux_1 < aux_2 on disk). The hf
    pre-hooks (LayerInputCapture) and SGLang's `layers_to_capture` (patches/sglang_capture.py) both use this.
    """
    layer_ids = [int(layer) for layer in aux_layers]
    if sorted(set(layer_ids)) != layer_ids:
        raise ValueError(f"layer ids must be distinct and ascending, got {layer_ids}")
    return layer_ids


# --- finding the text model inside a Hugging Face model ----------------------------------------------

@dataclass
class TextModel:
    """The parts of a verifier that extraction uses: the base model (embeddings -> layers -> final norm)."""
    base: torch.nn.Module
    layers: torch.nn.ModuleList
    name: str
    lm_head: torch.nn.Module | None

    @property
    def input_device(self) -> torch.device:
        embeddings = self.base.get_input_embeddings() if hasattr(self.base, "get_input_embeddings") else None
        if embeddings is not None and getattr(embeddings, "weight", None) is not None:
            return embeddings.weight.device
        return next(self.base.parameters()).device


def find_text_model(model: torch.nn.Module, num_layers: int | None = None) -> TextModel:
    """Locate the decoder stack of any causal LM, including multimodal wrappers.

    Looks for the sub-module that owns both a list of decoder layers and a final norm (model.model for
    Llama/DeepSeek-V3, model.model.language_model for transformers' own multimodal classes,
    model.language_model.model for Kimi-K2.5's remote code, transformer for GPT-2 style), skipping vision
    and audio towers; with `num_layers`, the list must have that many layers.
    """
    candidates = []
    for name, module in model.named_modules():
        if any(word in name.lower() for word in _NOT_TEXT):
            continue
        layers = next((getattr(module, a) for a in _LAYER_LISTS
                       if isinstance(getattr(module, a, None), torch.nn.ModuleList)), None)
        has_norm = any(isinstance(getattr(module, a, None), torch.nn.Module) for a in _FINAL_NORMS)
        if layers is None or not has_norm or len(layers) == 0:
            continue
        if num_layers is not None and len(layers) != num_layers:
            continue
        candidates.append((name.count("."), len(name), name, module, layers))
    if not candidates:
        raise RuntimeError(f"{type(model).__name__}: found no sub-module with a list of "
                           f"{num_layers or 'any number of'} decoder layers and a final norm; this architecture "
                           f"is not supported by the hf backend")
    _, _, name, base, layers = min(candidates, key=lambda c: c[:3])
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm_head is None:
        lm_head = getattr(model, "lm_head", None)
    return TextModel(base=base, layers=layers, name=name or "<root>", lm_head=lm_head)


def run_base(text: TextModel, input_ids: torch.Tensor) -> torch.Tensor:
    """One forward of the base model (no LM head, no KV cache); returns the post-norm last hidden state."""
    out = text.base(input_ids=input_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# --- the capture of one batch ---------------------------------------------------------------

class TokenSelector:
    """Gathers the real (unpadded) tokens of a [B, S, H] batch into [N, H] in the stored dtype, per device."""

    def __init__(self, flat_index_cpu: torch.Tensor, store_dtype: torch.dtype | None):
        self.index_cpu = flat_index_cpu
        self.store_dtype = store_dtype
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        index = self._on.get(hidden.device)
        if index is None:
            index = self.index_cpu.to(hidden.device, non_blocking=True)
            self._on[hidden.device] = index
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        return rows if self.store_dtype is None else rows.to(self.store_dtype)  # None: as computed


def capture_batch(text: TextModel, capture: "LayerInputCapture", input_ids: torch.Tensor,
                  select: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """One forward of the verifier's base model with `capture` armed with `select`: [aux_0, aux_1, aux_2, final],
    each as `select` returns it. Stage 02 stores these; stage 04 --online trains on them at once."""
    capture.arm(select)
    final = run_base(text, input_ids)
    return capture.take() + [select(final)]


# --- the hook ----------------------------------------------------------------------------------------

class LayerInputCapture:
    """Forward pre-hooks that keep the real tokens of the residual stream entering chosen decoder layers.

    The input of layer l is exactly transformers' output_hidden_states[l] (index 0 = embedding output), and
    a pre-hook sees it without keeping the other L+1 states alive. The gather happens inside the hook, so a
    later in-place change of the residual stream could not leak into what is stored.
    `arm(select)` before a forward and `take()` after it; with `select` given here the capture stays armed
    with it across forwards (a decoding loop). As a context manager it removes its hooks on exit.
    """

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: Sequence[int],
                 select: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.layer_ids = capture_layer_ids(layer_ids)
        self.captured: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        self._keep_armed = select is not None
        self._select = select
        self._handles = [layers[layer].register_forward_pre_hook(self._hook(k), with_kwargs=True)
                         for k, layer in enumerate(self.layer_ids)]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            if self._select is not None:
                hidden = args[0] if args else kwargs.get("hidden_states")
                if not torch.is_tensor(hidden):
                    raise RuntimeError(f"{type(module).__name__} (decoder layer {self.layer_ids[k]}) was called "
                                       f"without its hidden states as first argument or hidden_states=")
                self.captured[k] = self._select(hidden)
        return hook

    def arm(self, select) -> None:
        self.captured = [None] * len(self.layer_ids)
        self._select = select

    def take(self) -> list[torch.Tensor]:
        if not self._keep_armed:
            self._select = None
        missing = [layer for layer, t in zip(self.layer_ids, self.captured) if t is None]
        if missing:
            raise RuntimeError(f"decoder layer(s) {missing} were not called during the forward pass")
        out, self.captured = self.captured, [None] * len(self.layer_ids)
        return out

    def take_concatenated(self) -> torch.Tensor:
        """The captured states side by side, [B, T, len(layer_ids) * H]: the drafter's aux input."""
        return torch.cat(self.take(), dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> "LayerInputCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def whole(hidden: torch.Tensor) -> torch.Tensor:
    """Keep every position (a decoding loop); stage 02 passes a selector of the real tokens instead."""
    return hidden


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a whole causal LM (Llama-style, or nested in a multimodal wrapper)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return find_text_model(model, int(config.num_hidden_layers)).layers


def sample_states(text: TextModel, aux_layers: Sequence[int], input_ids: Sequence[int],
                  loss_from: int) -> dict[str, torch.Tensor]:
    """What stage 02 would store for one token sequence, as a batch of one for stage 04's validation, on
    the CPU (a caller may keep many): aux [1, S, 3H] (inputs of `aux_layers`), final [1, S, H], input_ids
    and a loss mask set from position `loss_from` on. Stage 05 uses it to score a drafter teacher-forced on
    the text it just decoded, through the same capture and forward as extraction."""
    from eagle3_pipeline.model.kernels import sdpa_without_cudnn

    capture = LayerInputCapture(text.layers, aux_layers)
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=text.input_device)
    try:
        with torch.inference_mode(), sdpa_without_cudnn():
            capture.arm(lambda hidden: hidden)
            final = run_base(text, ids)
            aux = torch.cat(capture.take(), dim=-1)
    finally:
        capture.remove()
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, loss_from:] = 1
    return {"input_ids": ids.cpu(), "loss_mask": loss_mask.cpu(), "aux": aux.cpu(), "final": final.cpu()}
