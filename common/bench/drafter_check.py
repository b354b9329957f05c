"""The drafter folder under test exists and fits the verifier, checked before anything is loaded."""
from __future__ import annotations

from pathlib import Path

from common.cli.errors import UsageError
from common.cli.flags import require
from common.formats.files import read_json


def check_drafter(args, verifier_info, log) -> dict:
    """The drafter folder exists and fits the verifier (hidden size, vocabulary, aux layers): before loading."""
    require(args, "draft_model_path")
    folder = Path(args.draft_model_path)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--draft-model-path {folder}: no drafter there (config.json missing); run 04_train.py "
                         f"or point --draft-model-path at a checkpoint folder such as RUN_DIR/checkpoints/best")
    config = read_json(folder / "config.json")
    if verifier_info is not None:
        from common.formats.checkpoint import check_drafter_dir

        problems = check_drafter_dir(folder, verifier_info=verifier_info)
        if problems:
            raise UsageError(f"--draft-model-path {folder} does not fit --model-path {args.model_path}:\n  "
                             + "\n  ".join(problems))
    from common.model.config import DrafterConfig

    log.info("drafter %s (%s): hidden %s, draft vocabulary %s of %s, aux layers %s (inputs of those decoder "
             "layers; eagle_config ids %s in SGLang's convention)", folder, folder.resolve().name,
             config.get("hidden_size"), config.get("draft_vocab_size"), config.get("vocab_size"),
             DrafterConfig.from_sglang_config(config).aux_layers,
             (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    return config
