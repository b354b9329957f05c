"""Speculative decoding with an EAGLE-3 drafter and a Hugging Face verifier (batch size 1).

One iteration of the loop:
  1. draft: the drafter proposes tokens from its last output without running the verifier. Chain
     drafting (topk 1) proposes k tokens in k-1 single-token steps after the extend of step 4; tree
     drafting (EAGLE-2/3) expands the topk best nodes at each depth, then keeps the num_draft_tokens-1
     candidates of highest cumulative draft log-probability (a tree closed under ancestors).
  2. verify: one verifier forward over [last committed token, drafts...] on top of its KV cache: a plain
     causal forward for a chain; a 4-D tree attention mask (each node sees the cache and its ancestors)
     and explicit position ids (depth) for a tree.
  3. accept: at temperature 0 the longest prefix equal to the verifier's argmax plus the verifier's own
     next token (so the output is the verifier's greedy output, token for token). At temperature > 0,
     chain: standard speculative sampling (accept d with min(1, p(d)/q(d)), else draw from the residual
     max(p - q, 0), and a bonus token from p after k acceptances); tree: the children of a node are
     deterministic (top-k), so the exact multi-candidate recursive rejection sampling with one-hot
     proposals reduces to drawing x ~ p at the node and descending into the child equal to x, else
     emitting x. Both leave the output distribution exactly the verifier's (temperature + top-p) one.
  4. roll back and extend: the verifier cache keeps the accepted path only (crop, or a gather for a tree);
     the drafter cache drops its draft-step entries and is extended with the accepted tokens paired with
     the verifier's aux hidden states of the verify forward (captured by forward pre-hooks on the input of
     decoder layers aux_layers, the convention of stage 02), which yields the next first draft.

Drafter alignment (EAGLE-3): the drafter entry at position t takes token x_{t+1} and the fused verifier
state g_t of token x_t, and predicts x_{t+2}; the next draft step feeds its own pre-norm output with the
token just drafted, at position t+1, and so on (positions continue as in EAGLE's reference inference;
training-time test keeps step-0 positions, a small mismatch every EAGLE-3 deployment shares).

Host synchronisation: one device-to-host transfer per iteration (the acceptance decision and the new
tokens), none while drafting; the temperature-0 path never computes a full-vocabulary softmax.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Iterable, Sequence

import torch

from common.verifier.loading import inference_attention

# --- small helpers -----------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_draft_shape(num_steps: int, topk: int, num_draft_tokens: int | None) -> int:
    """Tokens verified per step including the last committed one (SGLang's --speculative-num-draft-tokens).

    Chain (topk 1): num_steps + 1. Tree: at most 1 + topk + (num_steps - 1) * topk^2 candidates exist;
    the default is 1 + topk * num_steps.
    """
    if num_steps < 1 or topk < 1:
        raise ValueError(f"num_steps and topk must be >= 1 (got {num_steps}, {topk})")
    if topk == 1:
        if num_draft_tokens not in (None, num_steps + 1):
            raise ValueError(f"chain drafting (topk 1) verifies num_steps + 1 = {num_steps + 1} tokens; "
                             f"num_draft_tokens {num_draft_tokens} does not fit (leave it unset or use topk > 1)")
        return num_steps + 1
    most = 1 + topk + (num_steps - 1) * topk * topk
    if num_draft_tokens is None:
        return min(1 + topk * num_steps, most)
    if not 2 <= num_draft_tokens <= most:
        raise ValueError(f"num_draft_tokens {num_draft_tokens} must lie in 2..{most} for num_steps {num_steps} "
                         f"and topk {topk} (root + at most {most - 1} candidates)")
    return num_draft_tokens


class Sampler:
    """The verifier's decoding rule: argmax at temperature 0, else temperature + top-p sampling."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
        self.temperature, self.top_p, self.generator = temperature, top_p, generator

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities (float32) over the last dimension: softmax(logits / T), then top-p.

        Top-p keeps the smallest set of most probable tokens whose mass reaches top_p (at least one),
        the same set as transformers' TopPLogitsWarper.
        """
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p >= 1.0:
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= self.top_p, 0.0)
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return kept / kept.sum(dim=-1, keepdim=True)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of a [rows, V] probability matrix -> [rows]."""
        return torch.multinomial(probs, 1, generator=self.generator).view(-1)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token per row of [rows, V] logits -> [rows]."""
        if self.greedy:
            return logits.argmax(dim=-1)
        return self.draw(self.probs(logits))


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, draft_to_target: torch.Tensor,
                     sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling of a chain of k drafts, all on the device (no host sync).

    p [k+1, V]: the verifier's (warped) distributions after the root and after each draft; q [k, Vd]: the
    drafter's distributions the drafts were sampled from, over the draft vocabulary; draft_ids [k]: the
    drafts as draft-vocabulary ids (draft_to_target maps them to verifier ids). Draft j is accepted with
    probability min(1, p_j(d_j) / q_j(d_j)); after the first rejection at j the token is drawn from
    normalise(max(p_j - q_j, 0)), after k acceptances a bonus token from p_k. Every emitted token is then
    distributed exactly as p given the tokens before it, whatever q is.

    Returns (accepted: 0-d count a, fallback [k+1]): the emitted tokens are drafts[:a] + [fallback[a]].
    """
    k = q.shape[0]
    drafts = draft_to_target[draft_ids]
    p_at = p[:k].gather(1, drafts.view(k, 1)).squeeze(1)
    q_at = q.gather(1, draft_ids.view(k, 1)).squeeze(1)
    uniform = torch.rand(k, device=p.device, generator=sampler.generator)
    accepted = (uniform * q_at < p_at).int().cumprod(0).sum()  # u < p/q: probability min(1, p/q)
    q_full = torch.zeros(k, p.shape[1], device=p.device, dtype=p.dtype)
    q_full[:, draft_to_target] = q.to(p.dtype)
    residual = (p[:k] - q_full).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A zero residual means p <= q everywhere, i.e. p == q, where rejection cannot happen; p keeps the
    # draw well-defined for rows that are never used.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:k])
    # Row j < k: the replacement after a rejection at j; row k: the bonus token after k acceptances.
    fallback = sampler.draw(torch.cat([residual, p[k:]]))
    return accepted, fallback


# --- the verifier --------------------------------------------------------------------------------------

def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The verifier's list of decoder layers (Llama-style, or nested in a multimodal wrapper)."""
    count = int(_text_config(model.config).num_hidden_layers)
    for path in ("model.layers", "model.language_model.layers", "language_model.model.layers",
                 "model.language_model.model.layers", "transformer.h", "model.decoder.layers"):
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and "vision" not in name \
                and "visual" not in name:
            return module
    raise ValueError(f"cannot find the {count} decoder layers of {type(model).__name__}")


class AuxCapture:
    """Forward pre-hooks that keep the INPUT of decoder layers `indices` (= HF output_hidden_states[i]),
    the convention of stage 02; `take()` returns them concatenated [B, T, len(indices) * H]."""

    def __init__(self, layers: torch.nn.ModuleList, indices: Sequence[int]):
        self.layers, self.indices = layers, list(indices)
        self.captured: list[torch.Tensor | None] = [None] * len(self.indices)
        self.handles: list = []

    def _hook(self, slot: int, module, args, kwargs):
        self.captured[slot] = args[0] if args else kwargs["hidden_states"]

    def __enter__(self) -> "AuxCapture":
        for slot, index in enumerate(self.indices):
            self.handles.append(self.layers[index].register_forward_pre_hook(partial(self._hook, slot),
                                                                             with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.captured = [None] * len(self.indices)

    def take(self) -> torch.Tensor:
        if any(t is None for t in self.captured):
            raise RuntimeError("the verifier forward did not pass through every aux layer")
        out = torch.cat(self.captured, dim=-1)
        self.captured = [None] * len(self.indices)
        return out


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


# --- statistics ----------------------------------------------------------------------------------------

@dataclass
class GenerationStats:
    prompt_tokens: int
    num_positions: int = 0           # draft positions per verify step (k, or the tree depth)
    new_tokens: int = 0
    verifier_forwards: int = 0       # including the prefill
    drafter_forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verify step: accepted drafts + 1
    wall_s: float = 0.0
    stopped_by: str = "length"

    @property
    def verify_steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float | None:
        """Tokens per verify step, bonus token included."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    @classmethod
    def from_dict(cls, saved: dict) -> "GenerationStats":
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "verifier_forwards": self.verifier_forwards, "drafter_forwards": self.drafter_forwards,
                "verify_steps": self.verify_steps, "accept_lengths": list(self.accept_lengths), "tau": self.tau,
                "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s, "stopped_by": self.stopped_by}


def _append_until_stop(tokens: list[int], new: Iterable[int], max_new_tokens: int, eos: set[int],
                       stats: GenerationStats) -> bool:
    """Append new tokens up to the first EOS or the token budget; True when generation is finished."""
    for token in new:
        tokens.append(token)
        if token in eos:
            stats.stopped_by = "eos"
            return True
        if len(tokens) >= max_new_tokens:
            stats.stopped_by = "length"
            return True
    return False


def _as_input_ids(input_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[0] != 1:
        raise ValueError(f"batch size 1 only (input_ids of shape {tuple(ids.shape)})")
    if ids.shape[1] < 1:
        raise ValueError("empty prompt")
    return ids


# --- baselines -----------------------------------------------------------------------------------------

@torch.inference_mode()
@inference_attention()
def plain_decode(verifier: torch.nn.Module, input_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 runner: VerifierRunner | None = None) -> tuple[list[int], GenerationStats]:
    """The same loop without drafting: one verifier forward per token on top of the KV cache."""
    runner = runner or VerifierRunner(verifier)
    device = runner.device
    sampler = Sampler(temperature, top_p, make_generator(device, seed) if temperature > 0 else None)
    ids = _as_input_ids(input_ids, device)
    eos = set(eos_token_ids or ())
    stats = GenerationStats(prompt_tokens=ids.shape[1])
    tokens: list[int] = []
    synchronize(device)
    started = time.perf_counter()
    cache = runner.new_cache()
    logits = runner(ids, cache, last_only=True)
    stats.verifier_forwards += 1
    token = sampler.pick(logits[:, -1])
    finished = _append_until_stop(tokens, [int(token.item())], max_new_tokens, eos, stats)
    while not finished:
        logits = runner(token.view(1, 1), cache, last_only=True)
        stats.verifier_forwards += 1
        token = sampler.pick(logits[:, -1])
        finished = _append_until_stop(tokens, [int(token.item())], max_new_tokens, eos, stats)
    synchronize(device)
    stats.wall_s = time.perf_counter() - started
    stats.new_tokens = len(tokens)
    return tokens, stats


@torch.inference_mode()
@inference_attention()
def hf_generate(verifier: torch.nn.Module, input_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> tuple[list[int], GenerationStats]:
    """transformers' own generate (greedy, or temperature + top-p sampling with top-k off), timed."""
    from transformers import GenerationConfig

    device = next(verifier.parameters()).device
    ids = _as_input_ids(input_ids, device)
    eos = list(eos_token_ids or ())
    pad = eos[0] if eos else getattr(verifier.config, "pad_token_id", None)
    sample = temperature > 0
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample,
                              temperature=temperature if sample else None, top_p=top_p if sample else None,
                              top_k=0 if sample else None, eos_token_id=eos or None, pad_token_id=pad)
    if sample:
        torch.manual_seed(seed)
    synchronize(device)
    started = time.perf_counter()
    out = verifier.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    synchronize(device)
    stats = GenerationStats(prompt_tokens=ids.shape[1], wall_s=time.perf_counter() - started)
    tokens = out[0, ids.shape[1]:].tolist()
    stats.new_tokens = len(tokens)
    stats.verifier_forwards = len(tokens)
    stats.stopped_by = "eos" if tokens and tokens[-1] in set(eos) else "length"
    return tokens, stats


# --- the speculative decoder -----------------------------------------------------------------------------

class SpeculativeDecoder:
    """EAGLE-3 speculative decoding: `generate(input_ids, max_new_tokens, eos_token_ids) -> (tokens, stats)`.

    `verifier`: a transformers causal LM (SDPA attention for trees). `drafter`: common.model.drafter.Eagle3Drafter
    on the same device. num_steps: draft depth; topk: branches per step (1 = chain); num_draft_tokens: tokens
    verified per step including the last committed one (tree only; chain = num_steps + 1).
    """

    def __init__(self, verifier: torch.nn.Module, drafter: torch.nn.Module, num_steps: int = 3, topk: int = 1,
                 num_draft_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, aux_layers: Sequence[int] | None = None, explicit_mask: bool = True):
        from common.model.drafter import DrafterCache

        self.verifier = VerifierRunner(verifier)
        self.explicit_mask = explicit_mask
        self.drafter = drafter
        self.cache_type = DrafterCache
        self.num_steps, self.topk = num_steps, topk
        self.num_draft_tokens = resolve_draft_shape(num_steps, topk, num_draft_tokens)
        self.device = self.verifier.device
        self.generator = make_generator(self.device, seed) if temperature > 0 else None
        self.sampler = Sampler(temperature, top_p, self.generator)
        config = getattr(drafter, "config", None) or drafter.cfg
        self.aux_layers = list(aux_layers if aux_layers is not None else config.aux_layers)
        if len(self.aux_layers) != 3:
            raise ValueError(f"the drafter names {len(self.aux_layers)} aux layers ({self.aux_layers}); EAGLE-3 "
                             f"needs three (give aux_layers explicitly for a drafter config without them)")
        self.layers = decoder_layers(verifier)
        bad = [i for i in self.aux_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"aux layers {bad} outside the verifier's {len(self.layers)} decoder layers")
        # A weight the drafter computes with (its frozen embedding may be offloaded to the CPU).
        param = next((p for p in drafter.parameters() if p.requires_grad), None)
        param = param if param is not None else next(drafter.parameters())
        if param.device != self.device:
            raise ValueError(f"drafter on {param.device}, verifier on {self.device}: put both on one device")
        self.drafter_dtype = getattr(drafter, "compute_dtype", param.dtype)
        vd = int(config.draft_vocab_size)
        # Target id of every draft id, once: drafting then maps ids with one gather and no host work.
        self.draft_to_target = drafter.draft_to_target(torch.arange(vd, device=self.device)).to(torch.long)
        self.tree = topk > 1
        if self.tree:
            self.verifier.tree_mask(torch.ones(1, 1, dtype=torch.bool, device=self.device), torch.float32)

    @property
    def drafting(self) -> str:
        if self.tree:
            return f"tree (num_steps {self.num_steps}, topk {self.topk}, num_draft_tokens {self.num_draft_tokens})"
        return f"chain (num_steps {self.num_steps})"

    # --- drafter calls ---------------------------------------------------------------------------------
    def _draft_forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.decode(token_ids, hidden, positions, cache, attention_mask=mask)

    def _extend(self, token_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, cache, stats):
        """Drafter entries for committed tokens paired with the verifier's fused aux states; returns the
        last pre-norm output and draft logits (the source of the next first draft)."""
        hidden = self.drafter.fuse(aux.to(self.drafter_dtype))
        out, logits = self._draft_forward(token_ids, hidden, positions, cache)
        stats.drafter_forwards += 1
        return out[:, -1:], logits[:, -1]

    # --- the loop ------------------------------------------------------------------------------------
    @torch.inference_mode()
    @inference_attention()
    def generate(self, input_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = ()
                 ) -> tuple[list[int], GenerationStats]:
        ids = _as_input_ids(input_ids, self.device)
        n = ids.shape[1]
        eos = set(eos_token_ids or ())
        stats = GenerationStats(prompt_tokens=n, num_positions=self.num_steps)
        # Position ids as views of one tensor: slicing it costs no host-to-device copy inside the loop.
        positions = torch.arange(n + max_new_tokens + self.num_steps + 2, device=self.device).unsqueeze(0)
        tokens: list[int] = []
        synchronize(self.device)
        started = time.perf_counter()
        vcache, dcache = self.verifier.new_cache(), self.cache_type()
        with AuxCapture(self.layers, self.aux_layers) as capture:
            logits = self.verifier(ids, vcache, last_only=True)
            stats.verifier_forwards += 1
            first = self.sampler.pick(logits[:, -1])  # [1]
            # Drafter prefill: pairs (x_{t+1}, g_t) for t = 0 .. n-1, the last pairing the first new token.
            draft_in = torch.cat([ids[:, 1:], first.view(1, 1)], dim=1)
            h_last, z_last = self._extend(draft_in, capture.take(), positions[:, :n], dcache, stats)
            finished = _append_until_stop(tokens, [int(first.item())], max_new_tokens, eos, stats)
            root, committed = first.view(1, 1), n + 1  # root: last committed token, not yet in the verifier cache
            while not finished:
                step = self._tree_step if self.tree else self._chain_step
                new, ext_tokens, ext_aux = step(root, h_last, z_last, committed, vcache, dcache, capture,
                                                positions, stats)
                stats.verifier_forwards += 1
                stats.accept_lengths.append(len(new))
                finished = _append_until_stop(tokens, new, max_new_tokens, eos, stats)
                if finished:
                    break
                accepted = len(new)
                # Drafter rollback: drop the draft-step entries, re-enter the accepted tokens with the
                # verifier's own states for them.
                dcache.crop(committed - 1)
                h_last, z_last = self._extend(ext_tokens, ext_aux,
                                              positions[:, committed - 1:committed - 1 + accepted], dcache, stats)
                root = ext_tokens[:, -1:]
                committed += accepted
        synchronize(self.device)
        stats.wall_s = time.perf_counter() - started
        stats.new_tokens = len(tokens)
        return tokens, stats

    # --- chain -----------------------------------------------------------------------------------------
    def _chain_step(self, root, h_last, z_last, committed, vcache, dcache, capture, positions, stats):
        k, greedy = self.num_steps, self.sampler.greedy
        draft_ids, q_rows = [], []
        hidden, z = h_last, z_last
        for j in range(k):
            if greedy:
                draft_id = z.argmax(dim=-1)  # [1]
            else:
                q = self.sampler.probs(z)  # [1, Vd]
                draft_id = self.sampler.draw(q)
                q_rows.append(q[0])
            draft_ids.append(draft_id)
            if j < k - 1:
                # Position committed-1+j pairs the token just drafted with the drafter's own last output.
                token = self.draft_to_target[draft_id].view(1, 1)
                hidden, logits = self._draft_forward(token, hidden, positions[:, committed - 1 + j:committed + j],
                                                     dcache)
                stats.drafter_forwards += 1
                z = logits[:, -1]
        draft_ids = torch.cat(draft_ids)  # [k] draft-vocabulary ids
        drafts = self.draft_to_target[draft_ids]  # [k] verifier ids
        verify_in = torch.cat([root.view(1), drafts]).view(1, k + 1)
        mask = self.verifier.causal_mask(committed - 1, k + 1, self.verifier.dtype) if self.explicit_mask else None
        logits = self.verifier(verify_in, vcache, attention_mask=mask)[0]  # [k+1, V]
        aux = capture.take()
        if greedy:
            target = logits.argmax(dim=-1)  # [k+1]
            accepted = (target[:k] == drafts).int().cumprod(0).sum()
            packed = torch.cat([accepted.view(1), target]).tolist()  # the one sync of this iteration
            a = packed[0]
            new = packed[1:a + 2]
            ext_tokens = target[:a + 1]
        else:
            accepted, fallback = rejection_sample(self.sampler.probs(logits), torch.stack(q_rows), draft_ids,
                                                  self.draft_to_target, self.sampler)
            packed = torch.cat([accepted.view(1), drafts, fallback]).tolist()
            a = packed[0]
            new = packed[1:1 + a] + [packed[1 + k + a]]
            ext_tokens = torch.cat([drafts[:a], fallback[a:a + 1]])
        self.verifier.crop(vcache, committed + a)
        return new, ext_tokens.view(1, a + 1), aux[:, :a + 1]

    # --- tree ------------------------------------------------------------------------------------------
    def _tree_step(self, root, h_last, z_last, committed, vcache, dcache, capture, positions, stats):
        K, S, D = self.topk, self.num_steps, self.num_draft_tokens
        device, base = self.device, committed - 1
        eye = torch.eye(K, dtype=torch.bool, device=device)
        rows = torch.arange(K, device=device)

        # Depth 1: the topk children of the last committed token.
        log_probs = torch.log_softmax(z_last[0].float(), dim=-1)
        score, draft_id = log_probs.topk(K)
        cand_tokens, cand_scores = [self.draft_to_target[draft_id]], [score]
        cand_parents = [torch.full((K,), -1, device=device, dtype=torch.long)]
        cand_depths = [torch.ones(K, device=device, dtype=torch.long)]
        expanded_tokens, expanded_scores, expanded_index = cand_tokens[0], score, rows
        expanded_hidden = h_last.expand(1, K, h_last.shape[-1])
        ancestors = torch.zeros(K, 0, dtype=torch.bool, device=device)  # over earlier draft-step entries
        offset = K
        for step in range(1, S):
            # Feed the K expanded nodes of depth `step` at position base+step-1; each sees the committed
            # prefix, the entries of its own ancestors and itself.
            past = base + K * (step - 1)
            mask = torch.ones(K, past + K, dtype=torch.bool, device=device)
            mask[:, base:past] = ancestors
            mask[:, past:] = eye
            pos = positions[:, base + step - 1:base + step].expand(1, K)
            hidden, logits = self._draft_forward(expanded_tokens.view(1, K), expanded_hidden, pos, dcache,
                                                 mask[None, None])
            stats.drafter_forwards += 1
            child_scores = expanded_scores[:, None] + torch.log_softmax(logits[0].float(), dim=-1)
            top_scores, top_ids = child_scores.topk(K, dim=-1)  # [K, K]
            top_scores, top_ids = top_scores.reshape(-1), top_ids.reshape(-1)
            parent_rows = rows.repeat_interleave(K)
            cand_tokens.append(self.draft_to_target[top_ids])
            cand_scores.append(top_scores)
            cand_parents.append(expanded_index[parent_rows])
            cand_depths.append(torch.full((K * K,), step + 1, device=device, dtype=torch.long))
            if step < S - 1:
                best = top_scores.topk(K).indices
                chosen_parent = parent_rows[best]
                ancestors = torch.cat([ancestors[chosen_parent], eye[chosen_parent]], dim=1)
                expanded_hidden = hidden[:, chosen_parent]
                expanded_tokens, expanded_scores = cand_tokens[-1][best], top_scores[best]
                expanded_index = offset + best
            offset += K * K

        # The tree: the D-1 best candidates. A stable sort keeps a parent (score >= its child's, smaller
        # index) ahead of its children, so the chosen set is closed under ancestors.
        tokens, scores = torch.cat(cand_tokens), torch.cat(cand_scores)
        parents, depths = torch.cat(cand_parents), torch.cat(cand_depths)
        chosen = torch.sort(-scores, stable=True).indices[:D - 1].sort().values
        slot = torch.full((tokens.shape[0],), -1, device=device, dtype=torch.long)
        slot[chosen] = torch.arange(1, D, device=device)
        chosen_parents = parents[chosen]
        tree_parent = torch.cat([torch.zeros(1, device=device, dtype=torch.long),
                                 torch.where(chosen_parents < 0, 0, slot[chosen_parents.clamp_min(0)])])
        tree_eye = torch.eye(D, dtype=torch.bool, device=device)
        tree_anc = tree_eye
        for _ in range(S):
            tree_anc = tree_eye | tree_anc[tree_parent]
        tree_tokens = torch.cat([root.view(1), tokens[chosen]])  # [D]
        tree_positions = (base + torch.cat([torch.zeros(1, device=device, dtype=torch.long), depths[chosen]]))
        allowed = torch.cat([torch.ones(D, base, dtype=torch.bool, device=device), tree_anc], dim=1)
        verifier_dtype = next(self.verifier.model.parameters()).dtype
        logits = self.verifier(tree_tokens.view(1, D), vcache, position_ids=tree_positions.view(1, D),
                               attention_mask=self.verifier.tree_mask(allowed, verifier_dtype))[0]  # [D, V]
        aux = capture.take()
        # The verifier's token at every node: argmax, or one independent draw from p at that node.
        want = self.sampler.pick(logits)
        packed = torch.cat([want, tree_tokens[1:], tree_parent[1:]]).tolist()  # the one sync
        want, node_tokens, node_parents = packed[:D], [None] + packed[D:2 * D - 1], [None] + packed[2 * D - 1:]
        children: dict[int, list[int]] = {}
        for node in range(1, D):
            children.setdefault(node_parents[node], []).append(node)
        path, node = [], 0
        while True:
            follow = next((c for c in children.get(node, ()) if node_tokens[c] == want[node]), None)
            if follow is None:
                break
            path.append(follow)
            node = follow
        new = [node_tokens[c] for c in path] + [want[node]]
        keep = [0] + path
        self.verifier.keep(vcache, base, keep)
        keep_index = torch.tensor(keep, device=device)
        ext_tokens = torch.tensor(new, device=device, dtype=torch.long).view(1, len(new))
        return new, ext_tokens, aux[:, keep_index]
