"""The drafter folder under test exists and fits the verifier, checked before anything is loaded."""
from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.bench.settings import BenchConfig
from eagle3_pipeline.errors import UsageError, require
from eagle3_pipeline.formats.files import read_json


def check_drafter(config: BenchConfig, verifier_info, log) -> dict:
    """The drafter folder exists and fits the verifier (hidden size, vocabulary, aux layers): before loading."""
    require(config.inputs, "draft_model_path")
    folder = Path(config.inputs.draft_model_path)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--draft-model-path {folder}: no drafter there (config.json missing); run 04_train.py "
                         f"or point --draft-model-path at a checkpoint folder such as RUN_DIR/checkpoints/best")
    from eagle3_pipeline.model.checkpoint import check_drafter_dir
    from eagle3_pipeline.formats.checkpoint import check_drafter_readable

    check_drafter_readable(folder, "--draft-model-path")  # a damaged file is named, not "does not fit"
    config = read_json(folder / "config.json")
    if verifier_info is not None:
        problems = check_drafter_dir(folder, verifier_info=verifier_info)
        if problems:
            raise UsageError(f"--draft-model-path {folder} does not fit --model-path {config.verifier.model_path}:\n  "
                             + "\n  ".join(problems))
    from eagle3_pipeline.model.config import DrafterConfig

    log.info("drafter %s (%s): hidden %s, draft vocabulary %s of %s, aux layers %s (inputs of those decoder "
             "layers; eagle_config ids %s in SGLang's convention)", folder, folder.resolve().name,
             config.get("hidden_size"), config.get("draft_vocab_size"), config.get("vocab_size"),
             DrafterConfig.from_sglang_config(config).aux_layers,
             (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    return config


def check_verifier_weights(config: BenchConfig, log) -> None:
    """--model-path must have the weights of the verifier the drafter was trained for (and, in --mode eval, of the
    hidden states' verifier): the fingerprints stage 02 recorded and stage 04 carried (unless
    --allow-other-verifier)."""
    from eagle3_pipeline.formats.manifest import MANIFEST
    from eagle3_pipeline.verifier.fingerprint import check_same_weights

    model_path = config.verifier.model_path
    draft_model_path, data_dir = config.inputs.draft_model_path, config.inputs.data_dir
    if not model_path or config.mode == "server":  # server mode loads no verifier here
        return
    made_with = []
    if draft_model_path:
        folder = Path(draft_model_path)
        for path in (folder / MANIFEST, folder.parent / MANIFEST):  # the checkpoint, or its training run
            manifest = read_json(path) if path.is_file() else {}
            if manifest.get("stage") == "04_train":
                made_with.append((manifest, f"the drafter {folder} (trained by {path})"))
                break
    if config.mode == "eval" and data_dir and (Path(data_dir) / MANIFEST).is_file():
        made_with.append((read_json(Path(data_dir) / MANIFEST), f"--data-dir {data_dir}"))
    for manifest, where in made_with:
        check_same_weights(manifest.get("verifier_weights"), (manifest.get("verifier") or {}).get("path"),
                           model_path, config.verifier.allow_other_verifier, where, log)
