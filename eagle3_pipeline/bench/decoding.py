"""Generation statistics and the two no-drafting baselines speculative decoding is timed against."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Iterable

import torch

from eagle3_pipeline.bench.sampling import Sampler, make_generator
from eagle3_pipeline.bench.verifier_runner import VerifierRunner
from eagle3_pipeline.model.kernels import sdpa_without_cudnn


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def append_until_stop(tokens: list[int], new: Iterable[int], max_new_tokens: int, eos: set[int],
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


def as_input_ids(input_ids, device: torch.device) -> torch.Tensor:
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
@sdpa_without_cudnn()
def plain_decode(verifier: torch.nn.Module, input_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 runner: VerifierRunner | None = None) -> tuple[list[int], GenerationStats]:
    """The same loop without drafting: one verifier forward per token on top of the KV cache."""
    runner = runner or VerifierRunner(verifier)
    device = runner.device
    sampler = Sampler(temperature, top_p, make_generator(device, seed) if temperature > 0 else None)
    ids = as_input_ids(input_ids, device)
    eos = set(eos_token_ids or ())
    stats = GenerationStats(prompt_tokens=ids.shape[1])
    tokens: list[int] = []
    synchronize(device)
    started = time.perf_counter()
    cache = runner.new_cache()
    logits = runner(ids, cache, last_only=True)
    stats.verifier_forwards += 1
    token = sampler.pick(logits[:, -1])
    finished = append_until_stop(tokens, [int(token.item())], max_new_tokens, eos, stats)
    while not finished:
        logits = runner(token.view(1, 1), cache, last_only=True)
        stats.verifier_forwards += 1
        token = sampler.pick(logits[:, -1])
        finished = append_until_stop(tokens, [int(token.item())], max_new_tokens, eos, stats)
    synchronize(device)
    stats.wall_s = time.perf_counter() - started
    stats.new_tokens = len(tokens)
    return tokens, stats


@torch.inference_mode()
@sdpa_without_cudnn()
def hf_generate(verifier: torch.nn.Module, input_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> tuple[list[int], GenerationStats]:
    """transformers' own generate (greedy, or temperature + top-p sampling with top-k off), timed."""
    from transformers import GenerationConfig

    device = next(verifier.parameters()).device
    ids = as_input_ids(input_ids, device)
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
