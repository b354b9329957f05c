#!/usr/bin/env bash
# Prints the dense Hugging Face folder of a verifier given as a folder (printed as given) or as SmolLM2's .gguf file
# (converted once to smollm2-dense beside it by eagle3_pipeline.verifier.loading.densify_gguf; later calls reuse it).
#   DENSE=$(scripts/dense_verifier.sh VERIFIER)
set -euo pipefail
VERIFIER=$1
if [[ "$VERIFIER" != *.gguf ]]; then echo "$VERIFIER"; exit 0; fi
VERIFIER=$(realpath -s "$VERIFIER")  # absolute (links kept) before the cd below, so a relative path still names it
DENSE=$(dirname "$VERIFIER")/smollm2-dense
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
[ -f "$DENSE/config.json" ] || python3 -c "import sys
from pathlib import Path
from eagle3_pipeline.verifier.loading import densify_gguf
densify_gguf(Path(sys.argv[1]), Path(sys.argv[2]))" "$VERIFIER" "$DENSE" >&2  # progress to stderr: stdout is the path
echo "$DENSE"
