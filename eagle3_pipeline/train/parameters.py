"""The drafter's parameters in training: the compute dtype, casting, the trainable ones and their device."""
from __future__ import annotations

import torch


def compute_dtype_for(device: str, dtype: str) -> str:
    """--dtype on GPU; float32 on CPU, where bf16 matmuls are slow (and float32 is exact, which the resume
    test compares).

    Training computes in the parameters' dtype rather than under torch.autocast: eagle3_pipeline.model.drafter is built
    that way (its compute dtype is fc.weight.dtype; embeddings, RoPE tables and hidden states are cast to
    it), and scripts/lab/bench_train_step.py times exactly that configuration. bf16 parameters are paired with
    fp32 master weights and fp32 moments in the optimizer (DrafterAdamW), so the update has autocast's
    precision. evaluate() still takes an autocast dtype for inference callers with float32 weights.
    """
    return dtype if str(device).startswith("cuda") else "float32"


def amp_dtype_for(device: str, dtype: str) -> str | None:
    """For inference-only callers that keep float32 weights (stage 05 --mode eval): the autocast dtype on
    GPU, None on CPU. Training does not autocast (see compute_dtype_for)."""
    return None if compute_dtype_for(device, dtype) == "float32" else dtype


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Parameters to `dtype`, buffers untouched: model.to(bf16) would also round the float32 RoPE
    frequencies (inv_freq), which SGLang computes in float32."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the drafter computes: its trainable weights' device (the frozen embedding may be offloaded to
    the CPU, and it is the first parameter)."""
    return next(p for p in model.parameters() if p.requires_grad).device
