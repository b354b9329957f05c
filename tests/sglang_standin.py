"""A Hugging Face decoder stack arranged in SGLang's text-model calling convention, for testing the capture hooks
on CPU (SGLang's model code does not import here, in any checked release: it needs tvm_ffi, triton,
sgl_kernel/flashinfer and its distributed runtime).

What is SGLang's (sglang/srt/models/llama.py and deepseek_v2.py, checked in tests/test_sglang.py against every checked
release; where the releases differ, e.g. where the residual stream is completed, the stand-in does what they agree on):
  * `forward(input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None)` over the flat
    [T] tokens of several requests laid one after another (a prefill forward, no padding);
  * the residual stream is carried apart from the layers' output, and each layer's input boundary first
    completes `hidden + residual` (fused add + RMSNorm); for a layer i in `self.layers_to_capture` that completed
    residual stream is captured (at layer 0: the embedding output, which 0.5.17's Llama cannot capture: stage 02
    refuses that combination, patches/sglang_releases.py);
  * the final norm over `hidden + residual` is the return value, and `(hidden, aux list)` is returned while
    `layers_to_capture` is not empty.
What is a stand-in: the layers, norms and weights are transformers' (real models: stories260K, a tiny random
DeepSeek-V3), attention runs per request over that request's rows (as SGLang's ragged attention kernels do), and
`StandinForwardBatch` carries only the ForwardBatch fields the hooks read, under SGLang's names.

`StandinEngine` stands in for `sglang.Engine` in stage 02's supervised engine process: it installs the capture
plan's hooks on the stand-in text model, refuses a server argument the plan's SGLang release does not have (as
sglang.Engine's ServerArgs(**kwargs) does; read from that release's source), runs each `generate` call as prefill
forwards of at most `max_prefill_tokens` tokens, and answers an exception in a forward the way every checked
release does: the scheduler signals its parent (the engine's process), whose SIGQUIT handler kills its own process
tree, itself included. The stand-in runs its "scheduler" inside the engine's process, so it kills that process
directly. `STANDIN_FAIL_AT=N` makes forward N arrive with a cached prefix (as with the radix cache on), which the
hooks refuse.
"""
from __future__ import annotations

import enum
import os
import signal
import traceback
from dataclasses import dataclass

import torch


class StandinForwardMode(enum.IntEnum):  # the members of sglang's ForwardMode the hooks tell apart
    EXTEND = 1
    DECODE = 2
    MIXED = 3


@dataclass
class StandinForwardBatch:
    forward_mode: StandinForwardMode
    rids: list[str]
    input_ids: torch.Tensor  # [T]
    extend_seq_lens_cpu: list[int] | None
    extend_prefix_lens_cpu: list[int] | None


def pack(requests: list[tuple[str, torch.Tensor]], mode: StandinForwardMode = StandinForwardMode.EXTEND,
         prefixes: list[int] | None = None):
    """(input_ids [T], positions [T], forward batch) of requests laid one after another, as a prefill forward."""
    ids = torch.cat([tokens for _, tokens in requests])
    positions = torch.cat([torch.arange(len(tokens)) for _, tokens in requests])
    lengths = [len(tokens) for _, tokens in requests]
    batch = StandinForwardBatch(mode, [rid for rid, _ in requests], ids, lengths, prefixes or [0] * len(requests))
    return ids, positions, batch


class SGLangStyleTextModel(torch.nn.Module):
    """A transformers base model (LlamaModel, DeepseekV3Model) run the way SGLang's text models run."""

    def __init__(self, hf_base: torch.nn.Module):
        super().__init__()
        self.embed_tokens = hf_base.embed_tokens
        self.layers = hf_base.layers
        self.norm = hf_base.norm
        self.rotary_emb = hf_base.rotary_emb
        self.layers_to_capture: list[int] = []

    def _attention(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]):
        out, start = [], 0
        for length in lengths:
            rows = slice(start, start + length)
            attended, _ = layer.self_attn(hidden_states=x[rows][None], position_embeddings=(cos[:, rows], sin[:, rows]),
                                          attention_mask=None)
            out.append(attended[0])
            start += length
        return torch.cat(out)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary_emb(hidden[None], positions[None])
        lengths = list(forward_batch.extend_seq_lens_cpu)
        aux, residual = [], None
        for i, layer in enumerate(self.layers):
            # the layer's input boundary: complete the residual stream, normalise it (capture sees it first)
            residual = hidden if residual is None else hidden + residual
            if i in self.layers_to_capture:
                aux.append(residual.clone())
            x = layer.input_layernorm(residual)
            x = self._attention(layer, x, cos, sin, lengths)
            residual = x + residual
            hidden = layer.mlp(layer.post_attention_layernorm(residual)[None])[0]
        out = self.norm(hidden + residual)
        return (out, aux) if self.layers_to_capture else out


FAIL_AT_ENV = "STANDIN_FAIL_AT"
PLAN_ENV = "EAGLE3_SGLANG_CAPTURE_PLAN"  # patches.sglang_capture.PLAN_ENV (tests/test_sglang.py checks they agree)


def check_server_args(kwargs: dict, version: str) -> None:
    """Every keyword is a ServerArgs field of SGLang `version` (whose source tests/sglang_source.py finds)."""
    from sglang_source import ReleaseSource, release_root

    root = release_root(version)
    if root is None:
        raise RuntimeError(f"SGLang {version}'s source is not here to check the engine's settings against")
    unknown = set(kwargs) - set(ReleaseSource(version, root).server_args_fields())
    if unknown:
        raise TypeError(f"SGLang {version}'s ServerArgs has no field {', '.join(sorted(unknown))}")


class StandinEngine:
    """sglang.Engine's surface that stage 02 uses (__init__(**server args), generate, shutdown), on CPU."""

    def __init__(self, **kwargs):
        from eagle3_pipeline.verifier.capture import find_text_model
        from eagle3_pipeline.verifier.loading import load_verifier_model
        # Imported with the plan in the environment, the hooks module would hook SGLang's own classes (as in
        # SGLang's processes); the stand-in takes the plan out first and hooks its own class with it.
        plan_path = os.environ.pop(PLAN_ENV)
        from patches.sglang_capture import CapturePlan, install_plan_hooks

        plan = CapturePlan.read(plan_path)
        check_server_args(kwargs, plan.sglang_release)
        self.hooks = install_plan_hooks(plan, [SGLangStyleTextModel])
        model = load_verifier_model(kwargs["model_path"], "cpu", "float32")
        self.text = SGLangStyleTextModel(find_text_model(model).base)  # the hooks start reading the data here
        self.max_tokens = int(kwargs["max_prefill_tokens"])
        self.fail_at = int(os.environ.get(FAIL_AT_ENV, "-1"))
        self.forwards = 0

    def _forward(self, requests: list[tuple[str, torch.Tensor]]) -> None:
        prefixes = [1] * len(requests) if self.forwards == self.fail_at else None
        try:
            with torch.no_grad():
                self.text(*pack(requests, prefixes=prefixes))
        except Exception:  # SGLang: the scheduler logs it and SIGQUITs the engine's process, which kills its tree
            traceback.print_exc()
            os.kill(os.getpid(), signal.SIGKILL)
        self.forwards += 1

    def generate(self, input_ids, sampling_params, rid):
        assert sampling_params == {"max_new_tokens": 0}
        batch, tokens = [], 0
        for request, ids in zip(rid, input_ids):
            if batch and tokens + len(ids) > self.max_tokens:
                self._forward(batch)
                batch, tokens = [], 0
            batch.append((request, torch.tensor(ids, dtype=torch.int64)))
            tokens += len(ids)
        if batch:
            self._forward(batch)
        return [{"meta_info": {"finish_reason": {"type": "length", "length": 0}}} for _ in rid]

    def shutdown(self) -> None:
        if self.hooks._sink is not None:
            self.hooks._sink.close()  # every accepted sample on disk
        self.hooks.remove()
