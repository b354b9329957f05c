"""The SGLang releases the capture hooks are checked against, and everything that differs between them, in one
table: stage 02's preflight and engine settings, the hooks in SGLang's processes, and tests/test_sglang.py (which
reads each release's own source) all take their release facts from here. docs/extraction.md lists the
differences. No imports beyond the standard library: SGLang imports this package in every process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class TextModel:
    """A text-model class the hooks wrap, as one release writes it. Its forward returns (hidden, aux) while
    `layers_to_capture` lists layers; how the residual stream entering a listed layer reaches the aux differs."""
    module: str
    name: str
    decoder_layer: str
    # The keyword by which the layer loop hands decoder layer i a collector when i is listed; None when the loop
    # appends `hidden_states + residual` itself before calling layer i.
    loop_keyword: str | None
    # (method, keyword): the call in the decoder layer's forward, before its attention, that hands the completed
    # residual stream to that collector; None when the loop captures.
    layer_call: tuple[str, str] | None
    final_norm: str  # the name called for the final norm in the forward
    captures_layer_zero: bool  # listing layer 0 (the embedding output) works


@dataclass(frozen=True)
class SGLangRelease:
    version: str
    # ServerArgs settings exact capture needs (docs/extraction.md says why each); names differ by release.
    capture_settings: Mapping[str, Any]
    text_models: tuple[TextModel, ...]
    # Whether decoder layers take and return the residual as an argument (else it travels beside the hidden states).
    residual_in_layer_arguments: bool
    # (module, class, method) that completes the residual stream at a layer's input and hands it to the collector.
    input_boundary: tuple[str, str, str]
    # Whether the eager runner turns a MIXED batch into EXTEND before the model runs (else the model sees MIXED,
    # which the hooks refuse for stage-02 requests; enable_mixed_chunk=False keeps them out of such batches).
    mixed_runs_as_extend: bool
    registry_call: str  # what registry.py calls on the package named by SGLANG_EXTERNAL_MODEL_PACKAGE
    cuda_graph_switches: str  # the module that turns disable_prefill/decode_cuda_graph into the graph config
    accept_length_module: str  # where the server's /server_info sets avg_spec_accept_length

    def text_model(self, name: str) -> TextModel:
        return next(model for model in self.text_models if model.name == name)


# Settings both releases name alike: the prefix cache and chunked prefill would compute part of a prompt, mixed
# chunks add decode tails, overlap splits or reorders forwards, CUDA graphs and torch.compile skip the Python hooks.
SHARED_CAPTURE_SETTINGS = {
    "disable_radix_cache": True,
    "chunked_prefill_size": -1,
    "enable_mixed_chunk": False,
    "disable_prefill_cuda_graph": True,
    "disable_decode_cuda_graph": True,
    "enable_torch_compile": False,
    "enable_two_batch_overlap": False,
    "enable_single_batch_overlap": False,
    "disable_overlap_schedule": True,
    "dp_size": 1,
    "pp_size": 1,
    "enable_attn_tp_input_scattered": False,
    "skip_tokenizer_init": True,
}

V0_5_17 = SGLangRelease(
    version="0.5.17",
    # data-parallel attention is a switch here (0.5.23: a size); no layernorm sequence parallelism yet
    capture_settings={**SHARED_CAPTURE_SETTINGS, "enable_dp_attention": False},
    text_models=(
        # the loop adds `hidden_states + residual`, and layer 0's residual is still None: layer 0 cannot be listed
        TextModel("sglang.srt.models.llama", "LlamaModel", "LlamaDecoderLayer", None, None, "norm", False),
        TextModel("sglang.srt.models.deepseek_v2", "DeepseekV2Model", "DeepseekV2DecoderLayer",
                  "captured_last_layer_outputs",
                  ("prepare_attn_and_capture_last_layer_outputs", "captured_last_layer_outputs"), "norm", True),
    ),
    residual_in_layer_arguments=True,
    input_boundary=("sglang.srt.layers.communicator", "LayerCommunicator",
                    "prepare_attn_and_capture_last_layer_outputs"),
    mixed_runs_as_extend=False,
    registry_call="ModelRegistry.register",
    cuda_graph_switches="sglang.srt.server_args",
    accept_length_module="sglang.srt.managers.scheduler",
)

V0_5_23 = SGLangRelease(
    version="0.5.23",
    capture_settings={**SHARED_CAPTURE_SETTINGS, "attn_dp_size": 1, "enable_layernorm_sp": False},
    text_models=(
        TextModel("sglang.srt.models.llama", "LlamaModel", "LlamaDecoderLayer", "capture_output",
                  ("prepare", "capture"), "final_norm", True),
        TextModel("sglang.srt.models.deepseek_v2", "DeepseekV2Model", "DeepseekV2DecoderLayer",
                  "captured_last_layer_outputs", ("prepare", "capture_gathered"), "final_norm", True),
    ),
    residual_in_layer_arguments=False,
    input_boundary=("sglang.srt.layers.layer_boundary.stage", "StageBoundary", "_prepare_attention"),
    mixed_runs_as_extend=True,
    registry_call="import_model_classes",
    cuda_graph_switches="sglang.srt.arg_groups.cuda_graph_hook",
    accept_length_module="sglang.srt.managers.scheduler_components.internal_state",
)

RELEASES = {release.version: release for release in (V0_5_17, V0_5_23)}
CHECKED_VERSIONS = tuple(RELEASES)  # oldest first
NEWEST = RELEASES[CHECKED_VERSIONS[-1]]  # what requirements-test.txt installs, and what an untested release tries


def release_for(version: str | None) -> SGLangRelease:
    """The table entry that applies to an installed version: its own when checked, else the newest checked
    release's (used only once the preflight let an untested release through: --allow-untested-sglang)."""
    return RELEASES.get(version or "", NEWEST)


def version_problem(installed: str | None) -> str | None:
    """Why the installed SGLang is not a checked release (None when it is), with the fix."""
    install = " or ".join(f"pip install sglang=={version}" for version in reversed(CHECKED_VERSIONS))
    checked = " and ".join(CHECKED_VERSIONS)
    if installed is None:
        return (f"SGLang is not installed; --backend sglang needs a release the capture hooks are checked against "
                f"({checked}): {install} on the GPU machine, or use --backend hf")
    if installed not in RELEASES:
        return (f"SGLang {installed} is installed, but the capture hooks in patches/ are checked against SGLang "
                f"{checked} only (they use SGLang's internal model classes, which change between releases): "
                f"{install}, or use --backend hf, or try it anyway with --allow-untested-sglang (it then runs "
                f"with {NEWEST.version}'s settings)")
    return None
