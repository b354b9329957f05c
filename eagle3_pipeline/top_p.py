"""Top-p (nucleus) sampling's one rule, shared by stage 01's decoding loop and stage 05's sampler."""
from __future__ import annotations


def top_p_probabilities(probabilities, top_p: float):
    """`probabilities` [..., V] restricted to the smallest set of most probable tokens whose mass reaches `top_p`
    (at least one token; the same set as transformers' TopPLogitsWarper), renormalised; as given at top_p >= 1."""
    import torch

    if top_p >= 1.0:
        return probabilities
    ordered, order = probabilities.sort(dim=-1, descending=True)
    mass_before = ordered.cumsum(dim=-1) - ordered
    ordered = ordered.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probabilities).scatter_(-1, order, ordered)
    return kept / kept.sum(dim=-1, keepdim=True)
