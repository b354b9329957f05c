"""Every layer-id rule: which verifier layers feed the drafter, and the ids each server is given for them.

Our layers are HF `output_hidden_states` indices (the residual stream ENTERING a decoder layer); SGLang's
`eagle_config` ids are one less, except on its DeepSeek family. docs/conventions.md has the sources.
"""
from __future__ import annotations

from eagle3_pipeline.errors import UsageError

# What stage 02 records as the manifest's layer_convention and the drafter's metadata.
LAYER_CONVENTION = "hf_output_hidden_states_index (input of decoder layer)"

# Verifier architectures whose SGLang model class is deepseek_v2.py's (its own layer-id rule).
DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                   "KimiK25ForConditionalGeneration")


def server_default_layers(num_layers: int) -> list[int]:
    """The layers SGLang and vLLM capture when a drafter names no ids: [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers, as HF output_hidden_states indices (= inputs of those layers).

    [2, L//2, L-3] as SGLang and vLLM capture by default (2, 30, 58 for Kimi-K2.5's 61 layers). Verifiers
    too shallow for three distinct layers by that rule (L < 7, test models) get [1, L//2, L-2].
    """
    layers = server_default_layers(num_layers)
    if len(set(layers)) < 3 or layers[0] < 0:
        layers = [1, num_layers // 2, num_layers - 2]
    return layers


def check_aux_layers(layers: list[int], num_layers: int) -> list[int]:
    if len(layers) != 3:
        raise UsageError(f"--aux-layers needs exactly three layers, got {layers}")
    bad = [layer for layer in layers if not 0 <= layer <= num_layers - 1]
    if bad:
        raise UsageError(f"--aux-layers {layers}: {bad} outside 0..{num_layers - 1} "
                         f"(the verifier has {num_layers} decoder layers)")
    if sorted(set(layers)) != list(layers):
        raise UsageError(f"--aux-layers {layers}: give three distinct layers in ascending order")
    return list(layers)


def eagle_config_layer_ids(aux_layers: list[int], verifier_architecture: str | None = None) -> list[int]:
    """SGLang `eagle_config` ids that capture the INPUTS of decoder layers `aux_layers` (HF indices).

    SGLang captures before layer id+1 (docs/conventions.md), so the id is one less than the layer;
    DeepSeek-family verifiers shift only an id list that starts at 1. ValueError when no ids can work.
    """
    layers = [int(layer) for layer in aux_layers]
    if verifier_architecture in DEEPSEEK_FAMILY and layers and layers[0] != 2:
        if layers[0] == 1:
            raise ValueError(f"aux layers {layers}: SGLang cannot capture the input of layer 1 on "
                             f"{verifier_architecture} (its set_eagle3_layers_to_capture shifts ids only when the "
                             f"first one is 1); start the aux layers at 2 or later")
        return layers
    return [layer - 1 for layer in layers]


def aux_layers_from_eagle_config(layer_ids: list[int], verifier_architecture: str | None = None) -> list[int]:
    """Inverse of `eagle_config_layer_ids`: HF output_hidden_states indices SGLang captures for these ids."""
    ids = [int(layer_id) for layer_id in layer_ids]
    if verifier_architecture in DEEPSEEK_FAMILY and ids and ids[0] != 1:
        return ids
    return [layer_id + 1 for layer_id in ids]


def captured_layers(architecture: str, eagle_ids: list[int] | None, num_layers: int) -> list[int]:
    """The layers whose INPUT (HF output_hidden_states index) the pinned SGLang captures for these ids."""
    if not eagle_ids:
        return server_default_layers(num_layers)
    return aux_layers_from_eagle_config(eagle_ids, architecture)


def eagle_ids_for(architecture: str, layers: list[int]) -> list[int] | None:
    """eagle_config ids that make the pinned SGLang capture the inputs of `layers` (None: no ids can)."""
    try:
        return eagle_config_layer_ids(layers, architecture)
    except ValueError:
        return None
