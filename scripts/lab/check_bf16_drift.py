#!/usr/bin/env python
"""How far bf16 rounding alone moves a verifier's hidden states: transformers in bfloat16 against float32 on the same
random token ids, per layer (the output_hidden_states index), as the mean and the lowest single-token cosine.

    python scripts/lab/check_bf16_drift.py --model-path /tmp/dsv3 [--device cpu]

A dense model stays near 1 at every layer; an MoE model whose gate scores are near ties (a random one) routes some
tokens to other experts in bf16, and those tokens fall well below. This is the noise floor a comparison of two bf16
engines (scripts/check_sglang_capture.py) cannot beat. Prints one JSON object per layer.
"""
from __future__ import annotations

import argparse
import json

import torch


def hidden_states(model_path: str, dtype: torch.dtype, ids: torch.Tensor, device: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    with torch.no_grad():
        return [h.float().cpu() for h in model(ids.to(device), output_hidden_states=True).hidden_states]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="a Hugging Face model folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(args.model_path).vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(10, vocab_size - 10, (args.sequences, args.length), generator=generator)
    reference = hidden_states(args.model_path, torch.float32, ids, args.device)
    rounded = hidden_states(args.model_path, torch.bfloat16, ids, args.device)
    for index, (a, b) in enumerate(zip(reference, rounded)):
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        print(json.dumps({"hidden_states_index": index, "mean_cosine": round(float(cosine.mean()), 6),
                          "lowest_token_cosine": round(float(cosine.min()), 6)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
