#!/usr/bin/env python3
"""Check a drafter folder the way SGLang will load it: config fields, tensor keys/shapes/dtypes, the
vocabulary map, and (with --data-dir) the layer ids against the hidden states the drafter was trained on.

  python scripts/check_drafter.py RUN_DIR/checkpoints/best --data-dir RUN_DIR/hidden_states \
      [--model-path VERIFIER]

Prints every problem (exit 1) or "OK" (exit 0), warnings too. With --data-dir, SGLang or vLLM capturing other
layers than the stored ones is a problem.
Exit 2: bad arguments, an unreadable manifest/verifier config, or a damaged drafter file (named, with the fix).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="drafter folder (config.json + model.safetensors)")
    parser.add_argument("--data-dir", help="stage 02 output (its manifest.json gives aux_layers)")
    parser.add_argument("--model-path", help="the verifier, to compare vocabulary and hidden sizes")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--json", action="store_true", help="print {problems, warnings} as JSON")
    args = parser.parse_args(argv)

    from eagle3_pipeline.errors import UsageError
    from eagle3_pipeline.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE, check_drafter_readable
    from eagle3_pipeline.model.checkpoint import inspect_drafter_dir

    folder = Path(args.drafter)
    if all((folder / name).is_file() for name in (CONFIG_FILE, WEIGHTS_FILE)):  # missing ones: listed as problems
        try:
            check_drafter_readable(args.drafter)
        except UsageError as err:
            print(str(err), file=sys.stderr)
            return 2
    manifest = None
    if args.data_dir:
        path = Path(args.data_dir) / "manifest.json"
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
            print(f"--data-dir {args.data_dir}: cannot read {path} ({err})", file=sys.stderr)
            return 2
    info = None
    if args.model_path:
        from eagle3_pipeline.verifier.loading import read_verifier_info

        try:
            info = read_verifier_info(args.model_path, args.trust_remote_code, with_tokenizer_hash=False)
        except UsageError as err:
            print(str(err), file=sys.stderr)
            return 2
    # Served drafters: vLLM capturing other layers than those stored is a problem, as it is for SGLang.
    problems, warnings = inspect_drafter_dir(args.drafter, manifest, info, for_vllm=True)
    if args.json:
        print(json.dumps({"problems": problems, "warnings": warnings}, indent=2))
    else:
        for line in warnings:
            print(f"warning: {line}")
        for line in problems:
            print(f"problem: {line}")
        if not problems:
            print(f"OK: {args.drafter} is a valid LlamaForCausalLMEagle3 drafter")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
