"""scripts/sglang_launch_command.py: the SGLang command that serves a drafter, checked against the installed release.

The verifiers: stories260K (a real Llama folder) with a real drafter saved by eagle3_pipeline.model.checkpoint, and a
Kimi-K2.5 shaped config (its config.json only, as published: multimodal wrapper, nested DeepSeek-V3 text config, int4
compressed-tensors quantization, remote code) with drafter folders whose config.json is the real export of a
Kimi-shaped DrafterConfig (their weights file holds no tensors: the command reads configs only). Every flag the
command uses is looked up in the installed SGLang's ServerArgs and choice lists (read with ast, tests/sglang_source.py).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import sglang_source as src
from conftest import run_script
from eagle3_pipeline.formats.layer_ids import eagle_ids_for
from eagle3_pipeline.verifier.sglang_launch import (SM120_ATTENTION_BACKEND, SM120_DRAFT_ATTENTION_BACKEND,
                                                    build_launch_command)

KIMI_TEXT = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
             "num_hidden_layers": 61, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
             "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
             "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
             "v_head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 262144}
KIMI_QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32, "strategy": "group",
                                                        "type": "int"}}}}


def kimi_folder(folder: Path, quant_at_top: bool = False) -> Path:
    folder.mkdir(parents=True)
    text = dict(KIMI_TEXT)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                           "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
              "text_config": text, "vision_config": {"model_type": "moonvit"}}
    if quant_at_top:
        config["quantization_config"] = KIMI_QUANT
    else:
        text["quantization_config"] = KIMI_QUANT
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def kimi_drafter(folder: Path, verifier: Path, layers: list[int], eagle_ids: list[int] | None = None) -> Path:
    """A Kimi-shaped drafter folder: the exporter's config.json (optionally with other eagle_config ids)."""
    from safetensors.torch import save_file

    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.verifier.loading import read_verifier_info

    info = read_verifier_info(str(verifier), with_tokenizer_hash=False)
    config = DrafterConfig.from_verifier(info, 32000, layers).to_sglang_config()
    config["eagle3_pipeline"] = {"aux_layers": layers}
    if eagle_ids is not None:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = eagle_ids
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({}, str(folder / "model.safetensors"))
    return folder


def test_kimi_command_has_the_deployment_flags(tmp_path):
    verifier = kimi_folder(tmp_path / "kimi")
    drafter = kimi_drafter(tmp_path / "drafter", verifier, [2, 30, 58])
    command = build_launch_command(drafter, str(verifier), tp_size=8)
    argv = command.argv
    assert command.problems == []

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert value("--model-path") == str(verifier) and value("--tp-size") == "8"
    assert "--trust-remote-code" in argv  # the auto_map (Kimi's own config and tiktoken tokenizer code)
    assert value("--speculative-algorithm") == "EAGLE3"
    assert value("--speculative-draft-model-path") == os.path.abspath(drafter)
    assert (value("--speculative-num-steps"), value("--speculative-eagle-topk"),
            value("--speculative-num-draft-tokens")) == ("3", "1", "4")
    # SM120 (the default): the drafter's quantization follows --quantization, unset here, so no flag is needed
    assert "--speculative-draft-model-quantization" not in argv
    assert any("compressed-tensors" in note and "needs no quantization flag" in note for note in command.notes)
    assert value("--attention-backend") == SM120_ATTENTION_BACKEND == "triton"
    assert value("--speculative-draft-attention-backend") == SM120_DRAFT_ATTENTION_BACKEND == "triton"
    # the exporter's ids [1, 29, 57]: SGLang (DeepSeek family, first id 1) captures the inputs of 2, 30, 58
    assert any("[1, 29, 57]" in note and "[2, 30, 58]" in note for note in command.notes)
    shell = command.shell()
    assert shell.splitlines()[0] == "python -m sglang.launch_server \\"
    # SM100: SGLang reads the checkpoint's quantization into --quantization there, so the drafter is marked unquant
    sm100 = build_launch_command(drafter, str(verifier), tp_size=8, sm100=True)
    assert "    --speculative-draft-model-quantization unquant \\" in sm100.shell()
    # the quantization_config may sit at the top level too
    top = build_launch_command(drafter, str(kimi_folder(tmp_path / "kimi_top", quant_at_top=True)), sm100=True)
    assert "unquant" in top.argv


def test_layer_ids_that_sglang_would_read_differently_are_refused(tmp_path):
    verifier = kimi_folder(tmp_path / "kimi")
    # trained on 3, 31, 59 with ids written the "minus one" way: SGLang would take [2, 30, 58] as written
    shifted = kimi_drafter(tmp_path / "d1", verifier, [3, 31, 59], eagle_ids=[2, 30, 58])
    [problem] = build_launch_command(shifted, str(verifier)).problems
    assert "capture the inputs of layers [2, 30, 58]" in problem and "trained on layers [3, 31, 59]" in problem
    assert "set eagle_config.eagle_aux_hidden_state_layer_ids to [3, 31, 59]" in problem
    # the exporter itself writes the ids this verifier's SGLang class needs
    fixed = kimi_drafter(tmp_path / "d2", verifier, [3, 31, 59])
    assert json.loads((fixed / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        eagle_ids_for("KimiK25ForConditionalGeneration", [3, 31, 59]) == [3, 31, 59]
    assert build_launch_command(fixed, str(verifier)).problems == []
    # a first layer of 1 cannot be captured by this SGLang on a DeepSeek-family verifier
    [problem] = build_launch_command(kimi_drafter(tmp_path / "d3", verifier, [1, 30, 58]), str(verifier)).problems
    assert "no eagle_config ids make this SGLang capture them" in problem
    # tree settings and sizes
    command = build_launch_command(fixed, str(verifier), num_steps=5, topk=1, num_draft_tokens=4)
    assert any("num_steps + 1 = 6" in p for p in command.problems)


def test_script_on_a_real_llama_drafter(stories260k, tmp_path):
    from test_drafter import stories260k_drafter

    from eagle3_pipeline.model.checkpoint import save_drafter

    model, _, _, _ = stories260k_drafter(stories260k)
    save_drafter(model, tmp_path / "best", extra={"training": {"ttt_steps": 3}})  # as stage 04 records it
    proc = run_script("scripts/sglang_launch_command.py", str(tmp_path / "best"), "--model-path", str(stories260k),
                      "--tp-size", "1", "--json", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["problems"] == []
    assert "--speculative-draft-model-quantization" not in result["argv"]  # a dense verifier
    assert "--trust-remote-code" not in result["argv"]
    assert any("LlamaForCausalLM" in note for note in result["notes"])  # ids + 1 for Llama, as trained
    assert result["command"].startswith("python -m sglang.launch_server \\\n    --model-path ")
    # plain output, and the exit codes: a missing folder is 2
    proc = run_script("scripts/sglang_launch_command.py", str(tmp_path / "best"), "--model-path", str(stories260k),
                      timeout=120)
    assert proc.returncode == 0 and "--speculative-algorithm EAGLE3" in proc.stdout
    assert "never trained" not in proc.stdout  # 3 steps served, 3 trained
    # serving deeper drafts than the training unrolled is allowed, with a note that says what to change
    deeper = build_launch_command(tmp_path / "best", str(stories260k), tp_size=1, num_steps=5, num_draft_tokens=6)
    assert deeper.problems == []
    assert any("trained to draft 3 steps" in note and "--ttt-steps 5" in note for note in deeper.notes), deeper.notes
    proc = run_script("scripts/sglang_launch_command.py", str(tmp_path / "nowhere"), "--model-path",
                      str(stories260k), timeout=120)
    assert proc.returncode == 2 and "no config.json" in proc.stderr


def test_every_flag_is_a_flag_of_the_installed_sglang(tmp_path):
    sglang = src.installed_source()  # skips without SGLang
    root = sglang.root
    verifier = kimi_folder(tmp_path / "kimi")
    command = build_launch_command(kimi_drafter(tmp_path / "d", verifier, [2, 30, 58]), str(verifier), port=30000,
                                   sm100=True)
    assert "--speculative-draft-model-quantization" in command.argv
    fields = sglang.server_args_fields()
    flags = [a for a in command.argv if a.startswith("--")]
    for flag in flags:
        name = flag[2:].replace("-", "_")
        assert fields.get(name) is True, f"{flag}: not a command-line flag of SGLang at {root}"
    choices = "sglang.srt.arg_groups.choices"
    assert SM120_ATTENTION_BACKEND in sglang.module_constant(choices, "ATTENTION_BACKEND_CHOICES")
    assert SM120_DRAFT_ATTENTION_BACKEND in sglang.module_constant(choices, "DRAFT_ATTENTION_BACKEND_CHOICES")
    assert "unquant" in sglang.module_constant(choices, "QUANTIZATION_CHOICES")
    assert (root / "launch_server.py").is_file()
    # SM120: the pinned triton attention kernels carry tile sizes for its smaller shared memory, and SGLang's own
    # default for MLA models there (neither Hopper nor SM100) is triton.
    assert "CUDA_CAPABILITY[0] == 12" in src.source_of(sglang.parse("sglang.kernels.ops.attention.extend_attention"))
    default = src.source_of(sglang.find_function("sglang.srt.arg_groups.model_override_base",
                                                 "get_default_attn_backend"))
    mla = default[default.index("# MLA architecture"):]
    assert "is_sm100" in mla and mla.rstrip().endswith('return "triton"')
    # The draft quantization defaults to --quantization (not the checkpoint's) unless given; "unquant" means None.
    serving = src.source_of(sglang.find_function("sglang.srt.arg_groups.serving_hook", "handle_missing_default_values"))
    assert "speculative_draft_model_quantization=cfg.quantization" in serving
    assert 'if cfg.speculative_draft_model_quantization == "unquant":' in serving
    # The draft's ModelConfig takes that value; the target's takes --quantization.
    config = src.source_of(sglang.find_method("sglang.srt.configs.model_config", "ModelConfig", "from_server_args"))
    assert re.search(r"cfg\.speculative_draft_model_quantization\s+if is_draft_model\s+else cfg\.quantization", config)
    # The checkpoint's compressed-tensors setting is read into --quantization only on SM100 (DeepSeek family, Kimi
    # included): elsewhere --quantization stays unset and the flag is not needed.
    resolution = src.source_of(sglang.find_function("sglang.srt.arg_groups.overrides",
                                                    "_deepseek_moe_quant_resolution"))
    sm100_branch = resolution[resolution.index("if get_platform().is_sm100:"):]
    assert 'overrides["quantization"] = quantization = quant_method' in sm100_branch
    assert resolution.index("get_quantization_config(hf_config)") > resolution.index("if get_platform().is_sm100:")
