"""The loop engine's decoding step as CUDA graphs captured by hand, one per pooled cache.

torch.compile's "reduce-overhead" mode records CUDA graphs too, but compiles the step again for every batch
shape (about 22 s each for SmolLM2 on an H100: a run of many prompt widths pays minutes), and its graph trees
fail with dynamic shapes in torch 2.11. Here the forward (eager, or compiled once with dynamic shapes) is
captured by torch.cuda.graph the first time a cache is decoded into, and replayed every step after. A
capture costs one step's time.

A graph reads and writes fixed addresses: the cache's tensors (a pooled cache keeps them; reset() zeroes them
in place), and the step's own input buffers, into which each call copies its tokens, positions and mask. So the
graph lives on the cache object and dies with it.
"""
from __future__ import annotations

from types import SimpleNamespace

GRAPH_ATTRIBUTE = "_decode_loop_graph"  # on the cache object: the graph of the step decoding into it


class GraphedStep:
    """Calls like the model's forward for one decoding step ([rows, 1] tokens into a StaticCache), replaying
    the graph captured for that cache; returns an object whose .logits are the graph's output buffer
    (overwritten by the next call)."""

    def __init__(self, forward, cache_keyword: str):
        self.forward = forward
        self.cache_keyword = cache_keyword

    def __call__(self, input_ids, position_ids, attention_mask, **rest):
        cache = rest[self.cache_keyword]
        step = cache.__dict__.get(GRAPH_ATTRIBUTE)
        if step is None or step.input_ids.shape != input_ids.shape or step.mask.shape != attention_mask.shape:
            step = self.capture(input_ids, position_ids, attention_mask, rest)
            cache.__dict__[GRAPH_ATTRIBUTE] = step
        step.input_ids.copy_(input_ids)
        step.position_ids.copy_(position_ids)
        step.mask.copy_(attention_mask)
        step.graph.replay()
        return SimpleNamespace(logits=step.logits)

    def capture(self, input_ids, position_ids, attention_mask, rest: dict) -> SimpleNamespace:
        """The step's graph for this cache, captured after one warm-up step (lazy initialisations must not
        happen inside a capture). The warm-up writes one position's keys and values and advances the cache's
        fill counters: the counters are put back, and the real step then overwrites that position."""
        import torch

        counters = fill_counters(rest[self.cache_keyword])
        saved = [counter.clone() for counter in counters]
        step = SimpleNamespace(input_ids=input_ids.clone(), position_ids=position_ids.clone(),
                               mask=attention_mask.clone(), graph=torch.cuda.CUDAGraph())
        given = dict(input_ids=step.input_ids, position_ids=step.position_ids, attention_mask=step.mask, **rest)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(**given)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(step.graph):
            step.logits = self.forward(**given).logits
        for counter, value in zip(counters, saved):
            counter.copy_(value)
        return step


def fill_counters(cache) -> list:
    """The cache layers' device fill counters (transformers 5.x StaticLayer.cumulative_length), which a
    captured step advances in place."""
    import torch

    counters = [getattr(layer, "cumulative_length", None) for layer in getattr(cache, "layers", ())]
    if not counters or not all(isinstance(counter, torch.Tensor) for counter in counters):
        raise RuntimeError(f"{type(cache).__name__} keeps no fill counter on the device in each layer "
                           "(transformers 5's StaticCache does): its decoding step cannot be captured as a CUDA "
                           "graph; set EAGLE3_DECODE_COMPILE=static")
    return counters
