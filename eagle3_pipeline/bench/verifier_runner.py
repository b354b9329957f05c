"""Running the Hugging Face verifier with a KV cache (the aux states come from eagle3_pipeline.verifier.capture)."""
from __future__ import annotations

import inspect
from typing import Sequence

import torch


class VerifierRunner:
    """Calls a transformers causal LM with a KV cache, whatever its version names the cache argument."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.device = next(model.parameters()).device
        self.attn_implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self._negative_crop: bool | None = None
        self._arange: torch.Tensor | None = None
        self.dtype = next(model.parameters()).dtype

    def new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()

    def __call__(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        kwargs = {self.cache_kw: cache, "use_cache": True}
        if last_only and self.keep_kw is not None:
            kwargs[self.keep_kw] = 1
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs)
        return out.logits[:, -1:] if last_only else out.logits

    def tree_mask(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A 4-D mask [1, 1, q, kv] in the form the attention implementation takes as a custom mask:
        bool (True = attend) for SDPA and flex, additive float (0 / -inf-ish) for eager."""
        if self.attn_implementation in ("sdpa", "flex_attention"):
            return allowed[None, None]
        if "flash" in self.attn_implementation:
            raise ValueError("tree drafting needs a custom attention mask, which flash attention does not take; "
                             "load the verifier with attn_implementation='sdpa' (or use --topk 1)")
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]

    def causal_mask(self, past: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask of `length` new tokens after `past` cached ones, built in one comparison.

        Given explicitly, transformers uses it as is; left to itself, it builds the same mask through its
        general masking code, which costs more host time than the verifier's layers on a small model.
        """
        if self._arange is None or self._arange.numel() < past + length:
            self._arange = torch.arange(max(2 * (past + length), 4096), device=self.device)
        kv = self._arange[:past + length]
        allowed = kv[None, :] <= kv[past:, None]
        return self.tree_mask(allowed, dtype)

    def crop(self, cache, length: int) -> None:
        """Keep the first `length` cached positions. transformers 5 takes the number of tokens to remove
        (negative); older versions the length to keep."""
        if self._negative_crop is None:
            self._negative_crop = "tokens_to_remove" in inspect.signature(cache.crop).parameters
        current = cache.get_seq_length()
        if current > length:
            cache.crop(length - current if self._negative_crop else length)

    def keep(self, cache, base: int, relative: Sequence[int]) -> None:
        """Keep positions [0, base) and then base + relative (ascending): a tree's accepted path."""
        if list(relative) == list(range(len(relative))):
            self.crop(cache, base + len(relative))
            return
        layers = getattr(cache, "layers", None)
        if layers is None or any(not hasattr(layer, "keys") or getattr(layer, "is_sliding", False)
                                 for layer in layers):
            raise RuntimeError("tree verification gathers cache positions and needs a DynamicCache with "
                               "full-attention layers (transformers >= 4.56); use --topk 1 here")
        index = torch.tensor([base + r for r in relative], device=layers[0].keys.device)
        for layer in layers:
            layer.keys = torch.cat([layer.keys[..., :base, :], layer.keys.index_select(-2, index)], dim=-2)
            layer.values = torch.cat([layer.values[..., :base, :], layer.values.index_select(-2, index)], dim=-2)
