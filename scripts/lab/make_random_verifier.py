#!/usr/bin/env python3
"""Write a small random verifier folder (Hugging Face format) with a real tokenizer, for checks that need an
architecture no small real model has here: a DeepSeek-V3 (MLA attention and MoE, the text model of Kimi-K2.5) with
DeepSeek's own head sizes, or a Llama.

    python scripts/lab/make_random_verifier.py --arch deepseek_v3 --tokenizer-from /models/SmolLM2 --out /tmp/dsv3
    python scripts/check_sglang_capture.py --model-path /tmp/dsv3 ...

The tokenizer files are copied from --tokenizer-from and the vocabulary sized to it. Weights are random (seed
--seed) in bfloat16, so nothing downloads; the config's shapes are printed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")

# Small in width and depth, DeepSeek-V3's own attention head sizes (MLA kernels are written for them).
DEEPSEEK_V3 = dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=16,
                   num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=512,
                   q_lora_rank=768, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   routed_scaling_factor=2.5, max_position_embeddings=4096, tie_word_embeddings=False,
                   # DeepSeek-V3's own config.json carries these; SGLang reads them, transformers' class omits them
                   moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc")
LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)


def build(arch: str, vocab_size: int, token_ids: dict):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    if arch == "deepseek_v3":
        return DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=vocab_size, **DEEPSEEK_V3, **token_ids))
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **LLAMA, **token_ids))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("deepseek_v3", "llama"), default="deepseek_v3")
    parser.add_argument("--tokenizer-from", required=True, help="a model folder whose tokenizer files are copied")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    out, source = Path(args.out), Path(args.tokenizer_from)
    if out.exists():
        print(f"--out {out} exists; give a new folder", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(source)
    token_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                 "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(args.seed)
    model = build(args.arch, len(tokenizer), token_ids).to(torch.bfloat16)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, partial / name)
    partial.rename(out)  # whole or absent
    config = json.loads((out / "config.json").read_text())
    print(json.dumps({"out": str(out), "architectures": config["architectures"], "vocab_size": config["vocab_size"],
                      "parameters": sum(p.numel() for p in model.parameters())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
