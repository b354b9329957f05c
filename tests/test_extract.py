"""Stage 02 (hidden-state extraction, hf backend) on real models: stories260K and a tiny random DeepSeek-V3.

What is checked: the stored tensors are exactly transformers' output_hidden_states[l] and the post-norm last
hidden state (lm_head(final) == logits); files, shapes, dtypes, manifest and index; a run killed with SIGKILL
and rerun gives files identical to an uninterrupted run; bad inputs are refused before any weight is read
(the verifier folders used for that have no weights at all, so a load would fail with exit code 1, not 2).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_script, save_tiny_deepseek_v3
from faults import fault_env
from eagle3_pipeline.formats.manifest import Manifest
from eagle3_pipeline.formats.files import read_json, write_json_atomic
from eagle3_pipeline.extract.extractor import Extractor
from eagle3_pipeline.extract.plan import plan_batches
from eagle3_pipeline.formats.hidden_states import (AUX_FILES, FINAL_FILE, LAYER_CONVENTION, META_FILE, RECORD_FILE,
    SAMPLE_FILES, TMP_PREFIX, load_sample, open_hidden_states, sample_dir_name)
from eagle3_pipeline.formats.prepared_data import read_prepared_data
from eagle3_pipeline.formats.storage import StorageFormat
from eagle3_pipeline.verifier.capture import find_text_model
from eagle3_pipeline.verifier.loading import load_verifier_model, read_verifier_info

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STAGE_SCRIPT = "02_extract_hidden_states.py"
_spec = importlib.util.spec_from_file_location("stage02", REPO / STAGE_SCRIPT)
stage02 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage02)

TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json")
# The models here are tiny: one intra-op thread avoids OpenMP barriers stalling on a busy 2-core machine.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


# --- helpers -------------------------------------------------------------------------------------------

def write_prepared_data(data_dir: Path, model_path: Path, lengths: list[int], seed: int = 0,
                        vocab_size: int = 512) -> Path:
    """A stage-01-style output: tokenized_data.jsonl + a complete manifest with the verifier's identity."""
    data_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    records = []
    for i, length in enumerate(lengths):
        ids = torch.randint(3, vocab_size, (length,), generator=generator).tolist()
        mask = [0] * (length // 3) + [1] * (length - length // 3)
        sample_id = f"conv {i}/turn:ü" if i == 1 else f"sample-{i:03d}"  # one id that is not a safe file name
        records.append({"id": sample_id, "input_ids": ids, "loss_mask": mask})
    path = data_dir / "tokenized_data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = Manifest(data_dir, "01_prepare_data", {"model_path": str(model_path)})
    manifest.data["verifier"] = read_verifier_info(str(model_path)).identity()
    manifest.data["counts"] = {"samples": len(records), "tokens": sum(lengths),
                               "loss_tokens": sum(sum(r["loss_mask"]) for r in records)}
    manifest.complete()
    return path


def weightless_copy(model_dir: Path, target: Path, **config_changes) -> Path:
    """The verifier's config and tokenizer without weights: anything that tries to load it fails."""
    target.mkdir(parents=True)
    for name in os.listdir(model_dir):
        if not name.endswith((".safetensors", ".bin")) and name != "model.safetensors.index.json":
            shutil.copy(model_dir / name, target / name)
    if config_changes:
        config = read_json(target / "config.json")
        config.update(config_changes)
        write_json_atomic(target / "config.json", config)
    return target


def extract(model: Path, data: Path, out: Path, *extra: str) -> int:
    return stage02.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                         "--device", "cpu", *extra])


def stage02_config(*flags: str, model_path: str = "/models/m"):
    """Stage 02's typed settings from a real command line, parsed by the stage's own parser."""
    from eagle3_pipeline.extract.config import ExtractionConfig

    args = stage02.parse(["--model-path", model_path, "--prepared-data", "/data/tokenized_data.jsonl",
                          "--output-dir", "/out", *flags])
    return ExtractionConfig.from_args(args)


def stage_log(out: Path) -> str:
    return (out / "logs" / f"{stage02.STAGE}.log").read_text()


def all_tensors(out: Path) -> dict[str, object]:
    found = {}
    for path in sorted(out.glob("shard_*/*/*.pt")):
        found[str(path.relative_to(out))] = torch.load(path, weights_only=True)
    return found


def assert_same_files(a: Path, b: Path) -> None:
    left, right = all_tensors(a), all_tensors(b)
    assert sorted(left) == sorted(right)
    for name in left:
        x, y = left[name], right[name]
        if isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), name


def reference_states(model, input_ids: torch.Tensor):
    """transformers' own output_hidden_states and logits for one unpadded sequence."""
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], out.logits[0]


# --- models ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, stories260k) -> Path:
    """A tiny random DeepSeek-V3 (MoE + MLA) with stories260K's tokenizer (vocabulary 512)."""
    folder = save_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3_tiny"), num_hidden_layers=6)
    for name in TOKENIZER_FILES:
        shutil.copy(stories260k / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def stories_weightless(tmp_path_factory, stories260k) -> Path:
    return weightless_copy(stories260k, tmp_path_factory.mktemp("nw") / "stories260K_no_weights")


# --- unit-level -------------------------------------------------------------------------------------------

def test_plan_batches_respects_limits_and_is_deterministic(stories260k, tmp_path):
    lengths = [5, 40, 17, 33, 8, 40, 2, 25, 12, 30]
    data = write_prepared_data(tmp_path / "data", stories260k, lengths)
    samples, _ = read_prepared_data(data, 512, max_seq_len=32)
    assert [s.num_tokens for s in samples] == [min(n, 32) for n in lengths]
    assert [s.truncated for s in samples] == [n > 32 for n in lengths]
    batches = plan_batches(samples, batch_size=3, max_tokens_per_batch=64)
    assert sorted(i for b in batches for i in b) == list(range(len(samples)))
    for batch in batches:
        longest = max(samples[i].num_tokens for i in batch)
        assert len(batch) <= 3 and (len(batch) == 1 or longest * len(batch) <= 64)
    assert samples[batches[0][0]].num_tokens == 32  # longest first
    assert plan_batches(samples, 3, 64) == batches
    assert sample_dir_name("sample-001") == "sample-001"
    odd = sample_dir_name("conv 1/turn:ü")
    assert "/" not in odd and odd != sample_dir_name("conv 1/turn:u") and not odd.startswith(".")


def test_the_config_is_built_once_from_the_parsed_flags_and_the_library_takes_it():
    import inspect

    from eagle3_pipeline.extract import run, sglang_backend

    config = stage02_config("--backend", "sglang", "--tp-size", "8", "--batch-size", "16", "--aux-layers", "1,4,7",
                            "--targets", "topk", "--target-topk", "8", "--sglang-arg", "grammar_backend=none",
                            "--attention-backend", "triton", "--trust-remote-code", "--overwrite")
    assert (config.backend, config.aux_layers, config.run_dir) == ("sglang", (1, 4, 7), None)
    assert (config.verifier.model_path, config.verifier.trust_remote_code, config.verifier.device,
            config.verifier.dtype) == ("/models/m", True, "auto", "bfloat16")
    assert (config.batches.batch_size, config.batches.max_tokens_per_batch, config.batches.num_workers,
            config.batches.max_seq_len) == (16, None, 2, 2048)  # unset: the flag table's defaults
    assert (config.output.output_dir, config.output.overwrite, config.output.rebuild_manifest) == ("/out", True, False)
    assert (config.sglang.tp_size, config.sglang.gpu_memory_utilization, config.sglang.sglang_args) == \
        (8, 0.85, ("grammar_backend=none",))
    assert config.sglang.engine_settings() == {"grammar_backend": "none", "attention_backend": "triton"}
    storage = config.storage_format(vocab_size=512)
    assert (storage.aux_dtype, storage.targets, storage.topk, storage.dtype) == ("bfloat16", "topk", 8, "bfloat16")
    assert config.recorded_flags["target_topk"] == 8 and list(config.recorded_flags) == sorted(config.recorded_flags)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.backend = "hf"
    # the library's entry points take the typed settings, never the Namespace
    takes = {function: next(iter(inspect.signature(function).parameters.values())).annotation
             for function in (run.extract_hidden_states, run.build_manifest, sglang_backend.check_sglang_early,
                              sglang_backend.plan_capture_memory, sglang_backend.extract_with_sglang,
                              sglang_backend.resume_command)}
    assert set(takes.values()) == {"ExtractionConfig"}, takes
    assert next(iter(inspect.signature(run.check_existing_output).parameters)) == "output"
    assert inspect.signature(run.check_existing_output).parameters["output"].annotation == "OutputSettings"
    assert inspect.signature(sglang_backend.check_engine_settings).parameters["sglang"].annotation == "SGLangSettings"


# Stage 02's library, and its one module that may read the argparse Namespace (ExtractionConfig.from_args).
STAGE02_LIBRARY = ("eagle3_pipeline/extract/*.py", "eagle3_pipeline/verifier/sglang_settings.py",
                   "eagle3_pipeline/formats/storage.py")
READS_THE_NAMESPACE = {"eagle3_pipeline/extract/config.py"}


def test_no_function_below_stage02_takes_args_but_the_config_builder():
    import ast

    files = [path for pattern in STAGE02_LIBRARY for path in sorted(REPO.glob(pattern))]
    assert len(files) > 5 and REPO / "eagle3_pipeline/formats/storage.py" in files
    taking = []
    for path in files:
        name = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(param.arg == "args" for param in params) and name not in READS_THE_NAMESPACE:
                    taking.append(f"{name}:{node.lineno}")
    assert not taking, f"functions that take the Namespace (give them ExtractionConfig or plain values): {taking}"
    assert all((REPO / name).is_file() for name in READS_THE_NAMESPACE)


# --- content: exactly output_hidden_states[l] and the post-norm final state ---------------------------------

@pytest.mark.parametrize("which", ["stories", "deepseek"])
def test_capture_equals_output_hidden_states_and_lm_head_of_final(which, stories260k, deepseek_dir, tmp_path):
    model_dir = stories260k if which == "stories" else deepseek_dir
    info = read_verifier_info(str(model_dir))
    layers = [0, 2, info.num_layers - 1]  # includes index 0 (embedding output) and the last layer's input
    data = write_prepared_data(tmp_path / "data", model_dir, [9, 23, 16, 4, 23, 11])
    samples, _ = read_prepared_data(data, info.vocab_size, 2048)
    model = load_verifier_model(str(model_dir), "cpu", "float32")
    text = find_text_model(model, info.num_layers)
    assert text.name == "model"
    # batch size 1: each batch is one unpadded sequence, so the values must be bit-identical to transformers'.
    single = tmp_path / "single"
    with Extractor(single, samples, plan_batches(samples, 1, 4096), layers, info.hidden_size, torch.float32,
                   num_workers=1) as extractor:
        checkpoints = []
        extractor.run(text, plan_batches(samples, 1, 4096), on_checkpoint=checkpoints.append, checkpoint_s=0)
        assert extractor.written() == set(range(len(samples)))
        assert checkpoints and all(a <= b for a, b in zip(checkpoints, checkpoints[1:]))  # growing sets
    # padded batches: same values up to float rounding (padding never leaks into real tokens).
    # (and, as every batch has a new shape, without cuDNN's attention, which builds a graph per shape)
    padded = tmp_path / "padded"
    cudnn_flags = []
    hook = text.base.register_forward_pre_hook(
        lambda module, args: cudnn_flags.append(torch.backends.cuda.cudnn_sdp_enabled()))
    with Extractor(padded, samples, plan_batches(samples, 4, 4096), layers, info.hidden_size, torch.float32,
                   num_workers=0) as extractor:
        stats = extractor.run(text, plan_batches(samples, 4, 4096))
    hook.remove()
    assert stats.padded_tokens > stats.tokens_forwarded  # there was padding
    assert cudnn_flags and not any(cudnn_flags) and torch.backends.cuda.cudnn_sdp_enabled()
    for sample in samples:
        hidden, logits = reference_states(model, sample.input_ids)
        assert len(hidden) == info.num_layers + 1
        for folder, exact in ((single, True), (padded, False)):
            files = {name: torch.load(folder / sample.rel_path / name, weights_only=True) for name in SAMPLE_FILES}
            for k, layer in enumerate(layers):
                assert files[AUX_FILES[k]].shape == (sample.num_tokens, info.hidden_size)
                if exact:
                    assert torch.equal(files[AUX_FILES[k]], hidden[layer]), (which, layer)
                else:
                    torch.testing.assert_close(files[AUX_FILES[k]], hidden[layer], rtol=1e-4, atol=1e-5)
            final = files[FINAL_FILE]
            with torch.no_grad():
                head_logits = model.lm_head(final[None])[0]
            if exact:
                assert torch.equal(final, hidden[-1])  # transformers' last entry is post-norm
                assert torch.equal(head_logits, logits)
            else:
                torch.testing.assert_close(head_logits, logits, rtol=1e-4, atol=1e-5)
            assert torch.equal(files[META_FILE]["input_ids"], sample.input_ids)
            assert files[META_FILE]["loss_mask"].dtype == torch.uint8


def test_pre_norm_differs_from_final(deepseek_dir):
    """Guard for the convention: final is post-norm, i.e. differs from the last layer's raw output."""
    model = load_verifier_model(str(deepseek_dir), "cpu", "float32")
    text = find_text_model(model)
    ids = torch.arange(3, 20)[None]
    captured = {}
    handle = text.layers[-1].register_forward_hook(lambda m, a, o: captured.setdefault("out", o))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    handle.remove()
    raw_last = captured["out"][0] if isinstance(captured["out"], tuple) else captured["out"]
    assert not torch.allclose(raw_last[0], out.hidden_states[-1][0])
    torch.testing.assert_close(text.base.norm(raw_last)[0], out.hidden_states[-1][0])


def test_find_text_model_in_multimodal_wrappers(deepseek_dir):
    from transformers import (AutoConfig, CLIPVisionConfig, DeepseekV3ForCausalLM, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)

    # transformers' own multimodal layout: model.model.language_model + model.lm_head
    text_config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2)
    vision_config = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, image_size=8, patch_size=4)
    llava = LlavaForConditionalGeneration(LlavaConfig(text_config=text_config, vision_config=vision_config,
                                                      image_token_id=511)).eval()
    text = find_text_model(llava, 4)
    assert text.name == "model.language_model" and text.lm_head is llava.lm_head
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        reference = llava.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
    samples = [stage_sample(ids[0])]
    check_capture(text, samples, [1, 2, 3], reference)

    # Kimi-K2.5's remote-code layout (stand-in class with the same attribute structure): .language_model is a
    # DeepseekV3ForCausalLM, the text model is language_model.model.
    class KimiLikeWrapper(torch.nn.Module):
        def __init__(self, language_model):
            super().__init__()
            self.vision_tower = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(2, 2)]),
                                                     "norm": torch.nn.LayerNorm(2)})
            self.language_model = language_model

        def get_output_embeddings(self):
            return self.language_model.lm_head

    deepseek = DeepseekV3ForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    wrapper = KimiLikeWrapper(deepseek)
    text = find_text_model(wrapper, AutoConfig.from_pretrained(deepseek_dir).num_hidden_layers)
    assert text.name == "language_model.model" and text.lm_head is deepseek.lm_head


def stage_sample(ids: torch.Tensor):
    from eagle3_pipeline.formats.prepared_data import Sample

    return Sample(position=0, id="s", input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.uint8))


def check_capture(text, samples, layers, reference):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        batches = plan_batches(samples, 1, 4096)
        with Extractor(folder, samples, batches, layers, reference[0].shape[-1], torch.float32, 0) as extractor:
            extractor.run(text, batches)
        for k, layer in enumerate(layers):
            stored = torch.load(Path(folder) / samples[0].rel_path / AUX_FILES[k], weights_only=True)
            assert torch.equal(stored, reference[layer][0])
        assert torch.equal(torch.load(Path(folder) / samples[0].rel_path / FINAL_FILE, weights_only=True),
                           reference[-1][0])


# --- the stage, end to end ------------------------------------------------------------------------------------

def test_stage_deepseek_default_layers_files_manifest_and_reader(deepseek_dir, tmp_path):
    lengths = [12, 30, 7, 19, 30, 3, 25]
    data = write_prepared_data(tmp_path / "run" / "data", deepseek_dir, lengths)
    out = tmp_path / "run" / "hidden_states"
    assert extract(deepseek_dir, data, out, "--batch-size", "3", "--num-workers", "2") == 0
    manifest, entries = open_hidden_states(out)
    info = read_verifier_info(str(deepseek_dir))
    assert manifest["aux_layers"] == [1, 3, 4]  # default_aux_layers(6): too shallow for 2, L//2, L-3
    assert manifest["layer_convention"] == LAYER_CONVENTION
    assert manifest["hidden_size"] == 64 and manifest["dtype"] == "bfloat16"
    assert manifest["verifier"] == info.identity()
    assert manifest["counts"]["samples"] == len(lengths) and manifest["counts"]["tokens"] == sum(lengths)
    assert [e["num_tokens"] for e in entries] == lengths
    assert all(e["path"].startswith("shard_00000/") for e in entries)
    model = load_verifier_model(str(deepseek_dir), "cpu", "float32")
    for entry, length in zip(entries, lengths):
        assert sorted(os.listdir(out / entry["path"])) == sorted(SAMPLE_FILES + (RECORD_FILE,))
        sample = load_sample(out, entry)
        assert sample["aux"].shape == (length, 3 * 64) and sample["aux"].dtype == torch.bfloat16
        assert sample["final"].shape == (length, 64) and sample["final"].dtype == torch.bfloat16
        hidden, logits = reference_states(model, sample["input_ids"])
        reference_aux = torch.cat([hidden[layer] for layer in manifest["aux_layers"]], dim=-1)
        torch.testing.assert_close(sample["aux"].float(), reference_aux, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(sample["final"].float(), hidden[-1], rtol=1e-2, atol=1e-2)
        assert int(sample["loss_mask"].sum()) == entry["loss_tokens"]
    assert not list(out.glob(f"shard_*/{TMP_PREFIX}*"))


def test_kill_midway_then_rerun_gives_identical_files(stories260k, tmp_path):
    lengths = [(i * 37) % 60 + 5 for i in range(24)]
    data = write_prepared_data(tmp_path / "data", stories260k, lengths)
    flags = ["--batch-size", "4", "--aux-layers", "1,2,4", "--num-workers", "2"]
    killed = tmp_path / "killed"
    proc = run_script(STAGE_SCRIPT, "--model-path", str(stories260k), "--prepared-data", str(data),
                      "--output-dir", str(killed), "--device", "cpu", *flags, timeout=120,
                      env={**fault_env(crash_after_samples=10), **ONE_THREAD})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert read_json(killed / "manifest.json")["status"] == "running"
    done = [p for p in killed.glob("shard_00000/*") if not p.name.startswith(TMP_PREFIX)]
    assert 10 <= len(done) < 24
    # What a hard kill can leave besides: a temp folder, and a sample folder that lost a file.
    (killed / "shard_00000" / f"{TMP_PREFIX}sample-023_999").mkdir()
    (killed / "shard_00000" / f"{TMP_PREFIX}sample-023_999" / "aux_0.pt").write_bytes(b"partial")
    (done[0] / FINAL_FILE).unlink()

    assert extract(stories260k, data, killed, *flags) == 0
    assert "resuming:" in stage_log(killed)
    clean = tmp_path / "clean"
    assert extract(stories260k, data, clean, *flags) == 0
    assert_same_files(killed, clean)
    assert (killed / "index.jsonl").read_text() == (clean / "index.jsonl").read_text()
    assert not list(killed.glob(f"shard_*/{TMP_PREFIX}*"))


def test_finished_run_rerun_ends_at_once_without_loading(stories260k, tmp_path):
    model = tmp_path / "stories"
    shutil.copytree(stories260k, model)
    data = write_prepared_data(tmp_path / "data", model, [10, 20, 30])
    out = tmp_path / "out"
    assert extract(model, data, out) == 0
    before = all_tensors(out)
    (model / "model.safetensors").unlink()  # a load would now fail (exit 1)
    assert extract(model, data, out) == 0
    assert "nothing to do" in stage_log(out)
    # batch sizes do not change what is stored, so they may differ on a rerun (e.g. after an OOM)
    assert extract(model, data, out, "--batch-size", "1", "--max-tokens-per-batch", "16") == 0
    after = all_tensors(out)
    assert before.keys() == after.keys()


def test_overwrite_semantics(stories260k, tmp_path):
    data = write_prepared_data(tmp_path / "data", stories260k, [10, 20, 30, 14])
    out = tmp_path / "out"
    assert extract(stories260k, data, out, "--aux-layers", "1,2,3") == 0
    # other layers: refused, naming the difference and the ways out
    assert extract(stories260k, data, out, "--aux-layers", "0,2,4") == 2
    text = stage_log(out)
    assert "aux_layers: was [1, 2, 3], now [0, 2, 4]" in text and "--overwrite" in text
    # another stored dtype: refused too
    assert extract(stories260k, data, out, "--aux-layers", "1,2,3", "--dtype", "float32") == 2
    assert "dtype: was 'bfloat16', now 'float32'" in stage_log(out)
    # --overwrite replaces everything
    (out / "notes.txt").write_text("user file")
    assert extract(stories260k, data, out, "--aux-layers", "0,2,4", "--overwrite") == 0
    manifest, entries = open_hidden_states(out)
    assert manifest["aux_layers"] == [0, 2, 4] and len(entries) == 4
    assert (out / "notes.txt").exists()  # only the stage's own files are removed
    # shard folders without a manifest are of unknown origin
    foreign = tmp_path / "foreign"
    (foreign / "shard_00000" / "x").mkdir(parents=True)
    assert extract(stories260k, data, foreign) == 2
    assert "no manifest.json" in stage_log(foreign)


# --- refusals before the verifier loads -----------------------------------------------------------------------

def _refused(model: Path, data: Path, out: Path, *extra: str, expect: str) -> None:
    code = extract(model, data, out, *extra)
    text = stage_log(out)
    assert code == 2, text[-2000:]
    assert expect in text, text[-2000:]
    assert "loading the verifier" not in text


def test_refusals_before_any_load(stories_weightless, deepseek_dir, tmp_path):
    model = stories_weightless
    good = write_prepared_data(tmp_path / "good", model, [8, 12])
    # prepared for another verifier (same tokenizer and vocabulary, another hidden size)
    other = weightless_copy(model, tmp_path / "wider", hidden_size=96, head_dim=12)
    _refused(other, good, tmp_path / "o1", expect="hidden_size mismatch")
    # upstream stage not finished
    unfinished = write_prepared_data(tmp_path / "unfinished", model, [8])
    manifest = read_json(unfinished.parent / "manifest.json")
    manifest["status"] = "running"
    write_json_atomic(unfinished.parent / "manifest.json", manifest)
    _refused(model, unfinished, tmp_path / "o2", expect="did not finish")
    # no manifest at all / no file
    _refused(model, tmp_path / "nowhere" / "tokenized_data.jsonl", tmp_path / "o3", expect="no such file")
    # file edited after stage 01 wrote it
    edited = write_prepared_data(tmp_path / "edited", model, [8, 9])
    with open(edited, "a") as handle:
        handle.write(json.dumps({"id": "extra", "input_ids": [5, 6], "loss_mask": [0, 1]}) + "\n")
    _refused(model, edited, tmp_path / "o4", expect="its manifest")
    # token ids outside the vocabulary, on a named line
    bad_ids = write_prepared_data(tmp_path / "bad_ids", model, [8, 9])
    lines = bad_ids.read_text().splitlines()
    record = json.loads(lines[1])
    record["input_ids"][0] = 999
    bad_ids.write_text(lines[0] + "\n" + json.dumps(record) + "\n")
    _refused(model, bad_ids, tmp_path / "o5", expect=f"{bad_ids}:2")
    # a line that is not JSON, and a repeated id
    broken = write_prepared_data(tmp_path / "broken", model, [8, 9])
    broken.write_text(broken.read_text().splitlines()[0] + "\n{not json\n")
    _refused(model, broken, tmp_path / "o5b", expect=f"{broken}:2: not valid JSON")
    repeated = write_prepared_data(tmp_path / "repeated", model, [8, 9])
    first = repeated.read_text().splitlines()[0]
    repeated.write_text(first + "\n" + first + "\n")
    _refused(model, repeated, tmp_path / "o5c", expect="repeats line 1")
    # layer indices the verifier does not have
    _refused(model, good, tmp_path / "o6", "--aux-layers", "1,2,9", expect="outside 0..4")
    # a GPU that is not there
    if not torch.cuda.is_available():
        _refused(model, good, tmp_path / "o7", "--device", "cuda", expect="no CUDA GPU")
    # not enough disk: a verifier whose hidden states would need petabytes
    huge = weightless_copy(model, tmp_path / "huge", hidden_size=2 ** 40)
    huge_data = write_prepared_data(tmp_path / "huge_data", huge, [8, 12])
    _refused(huge, huge_data, tmp_path / "o8", expect="--allow-low-disk")
    # ... and with --allow-low-disk it goes past the check (and then fails: nothing can hold such tensors).
    assert extract(huge, huge_data, tmp_path / "o9", "--allow-low-disk") == 1
    assert "continuing: --allow-low-disk" in stage_log(tmp_path / "o9")


def test_bench_smoke_on_cpu(stories260k, tmp_path):
    out = tmp_path / "bench_out"
    out.mkdir()
    proc = run_script("scripts/lab/bench_extraction.py", "--device", "cpu", "--model-path", str(stories260k),
                      "--batch-size", "4", "--seq-len", "64", "--num-batches", "3", "--warmup-batches", "1",
                      "--num-workers", "2", "--disk-test-mb", "16", "--output-dir", str(tmp_path / "scratch"),
                      timeout=120, env={"OUT": str(out), **ONE_THREAD})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads((out / "bench_extraction.json").read_text())
    assert lines[-1] == result
    assert result["extraction"]["files_written"] == 3 * 4 * len(SAMPLE_FILES)
    assert result["extraction"]["tokens_per_s"] > 0 and result["forward_only"]["tokens_per_s"] > 0
    assert 0 < result["extraction_vs_forward"]
    assert result["disk"]["sequential_write_bytes_per_s"] > 0
    assert not (tmp_path / "scratch").exists() or not list((tmp_path / "scratch").rglob("*.pt"))


def test_bench_measures_the_storage_format_it_is_given(stories260k, tmp_path):
    """FP8 aux + top-k targets through the benchmark: the files and bytes of that format, not bf16's."""
    out = tmp_path / "bench_out"
    out.mkdir()
    proc = run_script("scripts/lab/bench_extraction.py", "--device", "cpu", "--model-path", str(stories260k),
                      "--batch-size", "4", "--seq-len", "64", "--num-batches", "2", "--warmup-batches", "1",
                      "--num-workers", "2", "--disk-test-mb", "8", "--naive-batches", "0",
                      "--aux-dtype", "float8_e4m3", "--targets", "topk", "--target-topk", "8",
                      "--output-dir", str(tmp_path / "scratch"), timeout=120, env={"OUT": str(out), **ONE_THREAD})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "bench_extraction.json").read_text())
    storage = StorageFormat("float8_e4m3", "topk", 8, vocab_size=512)
    assert result["storage"] == storage.key() == "aux float8_e4m3, targets top-8"
    assert result["bytes_per_token"] == storage.bytes_per_token(result["hidden_size"])
    assert result["bytes_per_token"] < StorageFormat().bytes_per_token(result["hidden_size"])  # bf16 + final's
    assert result["extraction"]["files_written"] == 2 * 4 * len(storage.files())
    assert result["extraction_vs_forward"] > 0


def test_bench_builds_a_random_verifier_of_a_known_shape(tmp_path):
    """--random-shape smollm2: SmolLM2-135M's shape with random weights (speed does not depend on them), so a
    machine without the checkpoint can measure it."""
    out = tmp_path / "bench_out"
    out.mkdir()
    proc = run_script("scripts/lab/bench_extraction.py", "--device", "cpu", "--random-shape", "smollm2",
                      "--batch-size", "2", "--seq-len", "32", "--num-batches", "1", "--warmup-batches", "0",
                      "--num-workers", "1", "--disk-test-mb", "4", "--naive-batches", "0",
                      "--output-dir", str(tmp_path / "scratch"), timeout=180, env={"OUT": str(out), **ONE_THREAD})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "bench_extraction.json").read_text())
    assert result["model"] == "random-smollm2-shape"
    assert result["hidden_size"] == 576 and result["aux_layers"] == [2, 15, 27]  # 30 layers: [2, L // 2, L - 3]
    assert result["bytes_per_token"] == StorageFormat().bytes_per_token(576)
    assert result["extraction"]["files_written"] == 2 * len(SAMPLE_FILES)
