"""The verifier's decoding rule (temperature + top-p) and lossless rejection sampling of a chain of drafts."""
from __future__ import annotations

import torch

from eagle3_pipeline.top_p import top_p_probabilities


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
        return top_p_probabilities(torch.softmax(logits.float() / self.temperature, dim=-1), self.top_p)

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
