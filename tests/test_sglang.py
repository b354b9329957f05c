"""Stage 02's SGLang backend (patches/sglang_capture.py, eagle3_pipeline/extract/sglang_backend.py), without a GPU.

Four kinds of checks:
  * the source of every SGLang release the hooks are checked against (patches/sglang_releases.py: 0.5.17 and
    0.5.23), read with ast from the installed wheel or from the source scripts/fetch_sglang_source.py unpacked
    (nothing of it imported): every module, class, method, attribute, signature and ForwardBatch field the hooks
    rely on, the route by which SGLang's processes load the hooks, the engine settings, the layer-id rules the
    launch command follows, and what the server benchmark reads from responses. Where the releases differ, the
    expected form comes from the release table, so a wrong table entry fails against that release's source;
  * the version dispatch: each checked release gets its own settings, another is refused (or tried, warned, with
    --allow-untested-sglang);
  * the capture logic on CPU, on Hugging Face models (stories260K and a tiny random DeepSeek-V3) run in SGLang's
    text-model calling convention (tests/sglang_standin.py), because SGLang's model code does not import without
    its GPU packages: the files written through the hooks equal transformers' output_hidden_states[l] and the
    final-norm state (exactly for a forward of one request; to float rounding for packed forwards);
  * stage 02's preflight with --backend sglang: clear refusals before any engine starts.
The SGLang engine itself runs only on a GPU machine; nothing here starts it.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch

import patches
import sglang_source as src
from conftest import REPO, save_tiny_deepseek_v3
from sglang_standin import SGLangStyleTextModel, StandinForwardMode, pack
from eagle3_pipeline.errors import UsageError
from patches.sglang_capture import (ACTIVE_FILE, CAPTURE_MODE, ERROR_FILE, FORWARD_BATCH_FIELDS, JOURNAL_FILE,
                                    TEXT_MODEL_ATTRIBUTES, CaptureError, CaptureHooks, CapturePlan, sample_rid)
from patches.sglang_releases import CHECKED_VERSIONS, NEWEST, RELEASES, release_for, version_problem

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
TEXT_MODELS = ("LlamaModel", "DeepseekV2Model")  # every checked release hooks these (checked below)


@pytest.fixture(scope="module", params=CHECKED_VERSIONS)
def checked_sglang(request) -> src.ReleaseSource:
    """The source of each checked release in turn (skipped, naming the setup command, when it is not here)."""
    return src.release_source(request.param)


@pytest.fixture
def installed_checked_sglang() -> str:
    """The installed SGLang's version, when it is a checked release (stage 02's preflight refuses any other)."""
    installed = src.installed_version()
    if installed not in RELEASES:
        pytest.skip(f"SGLang {installed} is installed, not a checked release ({', '.join(CHECKED_VERSIONS)}): "
                    f"bash scripts/setup_env.sh installs {NEWEST.version}")
    return installed


# --- the checked releases and the version dispatch -----------------------------------------------------------------

def test_the_checked_releases_are_the_ones_setup_env_provides():
    requirements = (REPO / "requirements-test.txt").read_text()
    assert re.search(rf"^sglang=={re.escape(NEWEST.version)}\s*(;.*)?$", requirements, re.M), requirements
    setup = (REPO / "scripts" / "setup_env.sh").read_text()
    assert "--no-deps -r requirements-test.txt" in setup and "python scripts/fetch_sglang_source.py" in setup
    spec = importlib.util.spec_from_file_location("fetch_sglang_source", REPO / "scripts" / "fetch_sglang_source.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    assert fetch.SOURCE_FOLDER == src.SOURCE_FOLDER and ".venv" in (REPO / ".gitignore").read_text().split()
    assert list(CHECKED_VERSIONS) == sorted(CHECKED_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    # Any mention of an installable sglang in the repository names a checked release.
    for path in [*REPO.glob("*.md"), *REPO.glob("*.txt"), *REPO.glob("docs/*.md"), *REPO.glob("scripts/*.*"),
                 *REPO.glob("scripts/lab/*.*"), *REPO.glob("eagle3_pipeline/**/*.py"), *REPO.glob("patches/*.py")]:
        for version in re.findall(r"sglang==([0-9][0-9A-Za-z.]*)", path.read_text()):
            assert version in CHECKED_VERSIONS, f"{path} names sglang=={version}"


def test_each_checked_release_gets_its_own_table_and_others_are_refused_with_the_fix():
    for version in CHECKED_VERSIONS:
        assert version_problem(version) is None and release_for(version).version == version
    assert RELEASES["0.5.17"].capture_settings != RELEASES["0.5.23"].capture_settings  # names differ
    missing = version_problem(None)
    assert "not installed" in missing and "--backend hf" in missing
    other = version_problem("0.5.22")
    assert "0.5.22" in other and "--backend hf" in other and "--allow-untested-sglang" in other
    for problem in (missing, other):
        assert all(f"pip install sglang=={version}" in problem for version in CHECKED_VERSIONS), problem
    assert release_for("0.5.22") is NEWEST  # what an allowed untested release runs with


def _fake_installed(monkeypatch, version: str | None) -> None:
    """stage 02 sees `version` installed (read from metadata, as the backend does)."""
    monkeypatch.setattr(patches, "installed_sglang_version", lambda: version)


def kimi_config():
    """Stage 02's settings for Kimi on 8 GPUs, from the stage's own parser."""
    from test_extract import stage02_config

    return stage02_config("--backend", "sglang", "--tp-size", "8", "--trust-remote-code", model_path="/models/kimi")


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_backend_dispatches_on_the_installed_release(monkeypatch):
    from eagle3_pipeline.log import get_logger
    from eagle3_pipeline.extract.sglang_backend import check_sglang_installed, engine_kwargs, installed_release

    config = kimi_config()
    for version in CHECKED_VERSIONS:
        _fake_installed(monkeypatch, version)
        assert installed_release() == (version, RELEASES[version]) and check_sglang_installed() == version
        kwargs = engine_kwargs(RELEASES[version], config, "/models/kimi", 64, 32768)
        assert {k: kwargs[k] for k in RELEASES[version].capture_settings} == dict(RELEASES[version].capture_settings)
        others = set().union(*(RELEASES[v].capture_settings for v in CHECKED_VERSIONS if v != version))
        assert not (others - set(RELEASES[version].capture_settings)) & set(kwargs)  # no other release's names
    _fake_installed(monkeypatch, "0.5.22")
    with pytest.raises(UsageError, match=r"--backend sglang: SGLang 0\.5\.22 is installed.*--allow-untested-sglang"):
        check_sglang_installed()
    warnings = _Warnings()
    get_logger().addHandler(warnings)
    try:
        assert check_sglang_installed(allow_untested=True) == "0.5.22"
    finally:
        get_logger().removeHandler(warnings)
    [warning] = warnings.messages
    assert "SGLang 0.5.22 is not a release the capture hooks are checked against" in warning
    assert f"with {NEWEST.version}'s settings" in warning
    assert installed_release(allow_untested=True) == ("0.5.22", NEWEST)
    _fake_installed(monkeypatch, None)  # nothing to try without SGLang, flag or not
    with pytest.raises(UsageError, match="SGLang is not installed"):
        check_sglang_installed(allow_untested=True)


def test_layer_zero_is_refused_where_the_release_cannot_capture_it(stories260k, monkeypatch):
    from eagle3_pipeline.verifier.loading import read_verifier_info
    from eagle3_pipeline.extract.sglang_backend import SUPPORTED_ARCHITECTURES, check_sglang_verifier

    info = read_verifier_info(str(stories260k), with_tokenizer_hash=False)  # a Llama
    model_path = str(stories260k)
    for version in CHECKED_VERSIONS:
        _fake_installed(monkeypatch, version)
        check_sglang_verifier(model_path, info, [1, 2, 3])
        for architecture, name in SUPPORTED_ARCHITECTURES.items():
            info.architecture = architecture
            if RELEASES[version].text_model(name).captures_layer_zero:
                check_sglang_verifier(model_path, info, [0, 2, 3])
            else:
                with pytest.raises(UsageError, match=rf"--aux-layers 0,2,3: SGLang {version}'s {name} cannot "
                                                     rf"capture layer 0.*sglang=={NEWEST.version}"):
                    check_sglang_verifier(model_path, info, [0, 2, 3])
        info.architecture = "LlamaForCausalLM"
    assert not RELEASES["0.5.17"].text_model("LlamaModel").captures_layer_zero


# --- the hook targets in each checked release's source ----------------------------------------------------------------

def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _called(node: ast.AST) -> list[ast.Call]:
    """Calls of a method or attribute (x.f(...)) inside a node."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]


def _assigned_self_attributes(function: ast.FunctionDef) -> set[str]:
    found = set(src.self_attributes_assigned(function))
    for node in ast.walk(function):  # self.layers, self.start_layer, self.end_layer = make_pp_layers(...)
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    found.update(e.attr for e in target.elts if isinstance(e, ast.Attribute)
                                 and isinstance(e.value, ast.Name) and e.value.id == "self")
    return found


def _lists_layer(test: ast.expr) -> bool:
    """`i in self.layers_to_capture`."""
    return isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.In) and \
        "layers_to_capture" in _names_in(test)


def _captures_when_listed(function: ast.FunctionDef) -> list[ast.keyword]:
    """Keyword arguments of the form `<kw>=<collector> if i in self.layers_to_capture else None`."""
    return [keyword for call in ast.walk(function) if isinstance(call, ast.Call) for keyword in call.keywords
            if isinstance(keyword.value, ast.IfExp) and _lists_layer(keyword.value.test)]


def _appends_sum_when_listed(function: ast.FunctionDef) -> bool:
    """`if i in self.layers_to_capture: <list>.append(hidden_states + residual)`, the loop capturing itself."""
    return any(isinstance(node, ast.If) and _lists_layer(node.test) and any(
        call.func.attr == "append" and call.args and isinstance(call.args[0], ast.BinOp)
        and isinstance(call.args[0].op, ast.Add) and {"hidden_states", "residual"} <= _names_in(call.args[0])
        for call in _called(node)) for node in ast.walk(function))


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_hooked_text_models_have_what_the_hooks_use(checked_sglang, name):
    model = checked_sglang.release.text_model(name)
    forward = checked_sglang.find_method(model.module, name, "forward")
    assert src.parameter_names(forward)[:4] == ["self", "input_ids", "positions", "forward_batch"]
    assigned = _assigned_self_attributes(checked_sglang.find_method(model.module, name, "__init__"))
    assert set(TEXT_MODEL_ATTRIBUTES) <= assigned, (name, set(TEXT_MODEL_ATTRIBUTES) - assigned)
    # While layer i is listed, the residual stream ENTERING it is captured: handed to the layer as a collector
    # (captured at its input boundary), or added up by the loop itself before it calls the layer.
    keywords = [keyword.arg for keyword in _captures_when_listed(forward)]
    if model.loop_keyword is not None:
        assert keywords == [model.loop_keyword] and model.captures_layer_zero
    else:
        assert keywords == [] and _appends_sum_when_listed(forward)
        # ... and before layer 0 there is no residual to add yet: layer 0 cannot be listed
        first = src.source_of(forward)
        assert "residual = None" in first and not model.captures_layer_zero
    # It returns (hidden states, aux) while layers are listed, and the hidden states are the final norm's.
    returns = [n for n in ast.walk(forward) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    assert any(len(r.value.elts) == 2 for r in returns), src.source_of(forward)
    assert any(call.func.attr == model.final_norm for call in _called(forward)), (name, model.final_norm)
    assert "norm" in _names_in(forward)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_decoder_layers_capture_their_input_before_attention(checked_sglang, name):
    release = checked_sglang.release
    model = release.text_model(name)
    forward = checked_sglang.find_method(model.module, model.decoder_layer, "forward")
    # the residual travels as the layers' argument (0.5.17) or beside them, in the forward batch (0.5.23)
    assert ("residual" in src.parameter_names(forward)) == release.residual_in_layer_arguments
    if model.layer_call is None:  # the model's loop captures (test above); the layer takes no collector
        assert not [p for p in src.parameter_names(forward) if "capture" in p]
        return
    method, keyword = model.layer_call
    assert model.loop_keyword in src.parameter_names(forward)
    prepare = [c for c in _called(forward) if c.func.attr == method and any(k.arg == keyword for k in c.keywords)]
    attention = [c for c in _called(forward) if c.func.attr == "self_attn"]
    assert prepare and attention
    assert prepare[0].lineno < attention[0].lineno  # the residual stream as it enters the layer, not after
    # ... where the input boundary completes the residual stream and hands it to the collector.
    module, class_name, boundary_name = release.input_boundary
    boundary = checked_sglang.find_method(module, class_name, boundary_name)
    assert keyword in src.parameter_names(boundary)
    assert any(keyword in _names_in(call.func) for call in _called(boundary)), src.source_of(boundary)
    assert "residual" in _names_in(boundary)


def test_the_verifier_classes_run_the_hooked_text_models(checked_sglang):
    from eagle3_pipeline.extract.sglang_backend import SUPPORTED_ARCHITECTURES

    sg, models = checked_sglang, "sglang.srt.models."
    assert {model.name for model in sg.release.text_models} == set(TEXT_MODELS) == set(SUPPORTED_ARCHITECTURES.values())
    deepseek = src.self_attributes_assigned(sg.find_method(models + "deepseek_v2", "DeepseekV2ForCausalLM",
                                                           "__init__"))
    assert src.source_of(deepseek["model"]).startswith("DeepseekV2Model(")
    assert [b.id for b in sg.find_class(models + "deepseek_v2", "DeepseekV3ForCausalLM").bases] == \
        ["DeepseekV2ForCausalLM"]
    kimi = src.self_attributes_assigned(sg.find_method(models + "kimi_k25", "KimiK25ForConditionalGeneration",
                                                       "__init__"))
    assert src.source_of(kimi["language_model"]).startswith("DeepseekV3ForCausalLM(")
    assert "language_model=self.language_model" in src.source_of(
        sg.find_method(models + "kimi_k25", "KimiK25ForConditionalGeneration", "forward"))
    llama_init = src.source_of(sg.find_method(models + "llama", "LlamaForCausalLM", "_init_model"))
    assert "LlamaModel(" in llama_init
    entry = {}
    for module in ("llama", "deepseek_v2", "kimi_k25"):
        for node in sg.parse(models + module).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                entry.update({e.id: module for e in node.value.elts if isinstance(e, ast.Name)})
    assert set(SUPPORTED_ARCHITECTURES) <= set(entry), set(SUPPORTED_ARCHITECTURES) - set(entry)


def test_forward_batch_has_the_fields_the_hooks_read(checked_sglang):
    sg, module = checked_sglang, "sglang.srt.model_executor.forward_batch_info"
    assert set(FORWARD_BATCH_FIELDS) <= sg.class_fields(module, "ForwardBatch")
    assert {CAPTURE_MODE, "MIXED", "DECODE", "TARGET_VERIFY"} <= sg.class_fields(module, "ForwardMode")
    assert {m.name for m in StandinForwardMode} <= sg.class_fields(module, "ForwardMode")
    init_new = src.source_of(sg.find_method(module, "ForwardBatch", "init_new"))
    assert "rids=[req.rid for req in batch.reqs]" in init_new  # the request ids stage 02 sends, in row order
    # The eager runner (CUDA graphs are off) runs a MIXED batch as EXTEND (0.5.23), so the hooks tell mixed-in decode
    # tails by their cached prefix, not by the mode; or it hands MIXED to the model (0.5.17), where the hooks refuse
    # a MIXED forward holding stage-02 requests, and enable_mixed_chunk=False keeps them out of such batches.
    execute = src.source_of(sg.find_method("sglang.srt.model_executor.runner.eager_runner", "EagerRunner",
                                           "execute"))
    if sg.release.mixed_runs_as_extend:
        mixed = execute[execute.index("if mode.is_mixed()"):]
        assert mixed.index("forward_batch.forward_mode = ForwardMode.EXTEND") < mixed.index("_execute_extend")
    else:
        assert "is_mixed" not in execute and "ForwardMode.EXTEND" not in execute
        assert "mode.is_extend(" in execute and CAPTURE_MODE != "MIXED"
        assert sg.release.capture_settings["enable_mixed_chunk"] is False


def test_sglang_processes_import_the_hooks_through_the_model_package_variable(checked_sglang):
    from patches import SGLANG_PACKAGE_ENV

    sg, registry_module = checked_sglang, "sglang.srt.models.registry"
    registry = src.source_of(sg.parse(registry_module))
    call = sg.release.registry_call
    assert f"envs.{SGLANG_PACKAGE_ENV}.get()" in registry and f"{call}(external_pkg" in registry
    if call != "import_model_classes":  # a registry method that imports the package's modules in turn
        method = sg.find_method(registry_module, "_ModelRegistry", call.split(".")[-1])
        assert "import_model_classes(package_name" in src.source_of(method)
    importer = src.source_of(sg.find_function(registry_module, "import_model_classes"))
    assert "pkgutil.iter_modules(package.__path__" in importer and "importlib.import_module(name)" in importer
    assert SGLANG_PACKAGE_ENV in sg.class_fields("sglang.srt.environ", "Envs")
    # The scheduler processes are spawned (fresh interpreters): a patch made in the stage's process would not reach
    # them, which is why the hooks travel this way.
    assert 'mp.set_start_method("spawn", force=True)' in src.source_of(sg.parse("sglang.srt.entrypoints.engine"))


def test_every_module_of_the_hooks_package_is_safe_for_sglang_to_import():
    """SGLang imports every module of the package: the hooks' module is one, none registers a model class, and
    without a plan in the environment (any process but stage 02's engine) importing them changes nothing."""
    import pkgutil

    names = {m.name for m in pkgutil.iter_modules(patches.__path__)}
    assert {"sglang_capture", "sglang_releases"} <= names
    for name in names:
        tree = ast.parse((Path(patches.__path__[0]) / f"{name}.py").read_text())
        assert not any(isinstance(n, ast.Name) and n.id == "EntryClass" for n in ast.walk(tree)), name
    # the release table is read in every SGLang process: the standard library only
    tree = ast.parse((Path(patches.__path__[0]) / "sglang_releases.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | \
        {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "typing"}, imported
    import patches.sglang_capture as capture

    assert capture.INSTALLED_HOOKS is None


def test_engine_settings_and_calls_exist_in_each_release(checked_sglang):
    from eagle3_pipeline.extract.sglang_backend import engine_kwargs
    from patches.sglang_releases import SHARED_CAPTURE_SETTINGS

    sg = checked_sglang
    kwargs = engine_kwargs(sg.release, kimi_config(), "/models/kimi", 64, 32768)
    fields = sg.server_args_fields()
    assert set(kwargs) <= set(fields), f"not server arguments of SGLang {sg.version}: {set(kwargs) - set(fields)}"
    assert kwargs["chunked_prefill_size"] == -1 and kwargs["disable_radix_cache"] is True
    assert set(SHARED_CAPTURE_SETTINGS) <= set(sg.release.capture_settings) <= set(kwargs)
    engine = "sglang.srt.entrypoints.engine"
    assert sg.find_method(engine, "Engine", "__init__").args.kwarg.arg == "kwargs"
    assert {"input_ids", "sampling_params", "rid"} <= set(src.parameter_names(sg.find_method(engine, "Engine",
                                                                                             "generate")))
    sg.find_method(engine, "Engine", "shutdown")
    # max_new_tokens=0 is a prefill-only request (no token is sampled)
    prefill_only = src.source_of(sg.find_method("sglang.srt.managers.schedule_batch", "Req", "is_prefill_only"))
    assert "max_new_tokens == 0" in prefill_only
    # A CUDA graph would replay kernels without running the hooks: both phases' graphs are turned off.
    switches = src.source_of(sg.parse(sg.release.cuda_graph_switches))
    assert re.search(r"if \w+\.disable_prefill_cuda_graph:", switches)
    assert re.search(r"if \w+\.disable_decode_cuda_graph:", switches)
    assert kwargs["disable_prefill_cuda_graph"] is True and kwargs["disable_decode_cuda_graph"] is True
    # Data-parallel attention would split a forward's rows over ranks: off, under this release's name.
    assert kwargs.get("attn_dp_size", 1) == 1 and kwargs.get("enable_dp_attention", False) is False
    assert {"attn_dp_size", "enable_dp_attention"} & set(sg.release.capture_settings)


def test_layer_id_rules_of_each_release(checked_sglang):
    """What eagle3_pipeline/formats/layer_ids.captured_layers encodes, as written in each release's source."""
    sg, models = checked_sglang, "sglang.srt.models."
    llama = src.source_of(sg.find_method(models + "llama", "LlamaForCausalLM", "set_eagle3_layers_to_capture"))
    assert "[2, num_layers // 2, num_layers - 3]" in llama and "[val + 1 for val in layer_ids]" in llama
    deepseek = src.source_of(sg.find_method(models + "deepseek_v2", "DeepseekV2ForCausalLM",
                                            "set_eagle3_layers_to_capture"))
    assert "if layer_ids and layer_ids[0] == 1:" in deepseek and "list(layer_ids)" in deepseek
    kimi = src.source_of(sg.find_method(models + "kimi_k25", "KimiK25ForConditionalGeneration",
                                        "set_eagle3_layers_to_capture"))
    assert "self.language_model.set_eagle3_layers_to_capture(layer_ids)" in kimi

    from eagle3_pipeline.formats.layer_ids import captured_layers, eagle_ids_for

    assert captured_layers("LlamaForCausalLM", [1, 14, 26], 30) == [2, 15, 27]
    assert captured_layers("KimiK25ForConditionalGeneration", [1, 29, 57], 61) == [2, 30, 58]
    assert captured_layers("DeepseekV3ForCausalLM", [2, 30, 58], 61) == [2, 30, 58]
    assert captured_layers("DeepseekV3ForCausalLM", None, 61) == [2, 30, 58]
    for arch in ("LlamaForCausalLM", "KimiK25ForConditionalGeneration"):
        for layers in ([2, 30, 58], [3, 31, 59], [5, 20, 40]):
            assert captured_layers(arch, eagle_ids_for(arch, layers), 61) == layers
    assert eagle_ids_for("DeepseekV3ForCausalLM", [1, 30, 58]) is None


def test_server_benchmark_reads_what_each_release_returns(checked_sglang):
    from eagle3_pipeline.bench.server import SERVER_INFO_PATHS

    sg = checked_sglang
    manager = src.source_of(sg.parse("sglang.srt.managers.tokenizer_manager"))
    for key in ("spec_verify_ct", "spec_accept_length"):
        assert f'meta_info["{key}"]' in manager
    assert '"completion_tokens": recv_obj.completion_tokens[i]' in manager
    server = sg.parse("sglang.srt.entrypoints.http_server")
    routes = {d.args[0].value for f in ast.walk(server) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for d in f.decorator_list if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)}
    assert set(SERVER_INFO_PATHS) <= routes
    assert '"internal_states": internal_states' in src.source_of(sg.find_function(
        "sglang.srt.entrypoints.http_server", "server_info"))
    assert re.search(r'\w+\["avg_spec_accept_length"\] =', src.source_of(sg.parse(sg.release.accept_length_module)))
    protocol = "sglang.srt.entrypoints.openai.protocol"
    assert "return_meta_info" in sg.class_fields(protocol, "ChatCompletionRequest")
    assert "meta_info" in sg.class_fields(protocol, "ChatCompletionResponseChoice")


def test_sglang_builds_the_model_after_torch_distributed(checked_sglang):
    """So is_first_rank() is known in the hooked text model's __init__, where the hooks start reading the data."""
    runner = "sglang.srt.model_executor.model_runner"
    init = src.source_of(checked_sglang.find_method(runner, "ModelRunner", "__init__"))
    assert init.index("self.init_torch_distributed()") < init.index("self.initialize(")
    assert "self.load_model()" in src.source_of(checked_sglang.find_method(runner, "ModelRunner", "initialize"))


# --- the capture logic on CPU ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verifiers(stories260k, tmp_path_factory):
    return {"stories": stories260k, "deepseek": save_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3_tiny"), 5)}


def _prepared(folder: Path, lengths: list[int], seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenized_data.jsonl"
    with open(path, "w") as handle:
        for i, length in enumerate(lengths):
            ids = torch.randint(3, 512, (length,), generator=generator).tolist()
            handle.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [i % 2] * length}) + "\n")
    return path


def _setup(model_dir: Path, tmp_path: Path, layers: list[int], lengths: list[int]):
    from eagle3_pipeline.formats.prepared_data import read_prepared_data
    from eagle3_pipeline.verifier.capture import find_text_model
    from eagle3_pipeline.verifier.loading import load_verifier_model

    data = _prepared(tmp_path / "data", lengths)
    samples, _ = read_prepared_data(data, 512, 2048)
    model = load_verifier_model(str(model_dir), "cpu", "float32")
    text = SGLangStyleTextModel(find_text_model(model).base)
    out = tmp_path / "hidden_states"
    out.mkdir()
    plan = CapturePlan(output_dir=str(out), prepared_data=str(data), vocab_size=512, max_seq_len=2048,
                       aux_layers=layers, dtype="float32", num_workers=2, sglang_version=NEWEST.version,
                       sglang_release=NEWEST.version)
    plan.write()
    return model, text, samples, plan


@pytest.mark.parametrize("which", ["stories", "deepseek"])
def test_capture_hooks_on_hf_models_in_sglang_calling_convention(which, verifiers, tmp_path):
    """Forwards as SGLang runs them: one request alone (exact), several packed with a request that is not stage
    02's in between, a decode forward (untouched), and a prefill of an already written sample (written once)."""
    from eagle3_pipeline.extract.output import scan_output
    from eagle3_pipeline.formats.hidden_states import AUX_FILES, FINAL_FILE, META_FILE, SAMPLE_FILES

    layers = [0, 2, 4]  # the embedding output, a middle layer's input, the last layer's input
    lengths = [13, 9, 21, 1, 16, 7]
    model, text, samples, plan = _setup(verifiers[which], tmp_path, layers, lengths)
    hooks = CaptureHooks(layers, plan.open_writer, on_error=plan.record_error,
                         on_first_batch=plan.mark_active).install(SGLangStyleTextModel)
    foreign = torch.randint(3, 512, (5,), generator=torch.Generator().manual_seed(9))
    forwards = [[0], [1, "warmup", 2, 3], [4, 5], [0]]
    try:
        with torch.no_grad():
            for group in forwards:
                requests = [("warmup-request", foreign) if i == "warmup" else (sample_rid(i), samples[i].input_ids)
                            for i in group]
                out = text(*pack(requests))
                assert torch.is_tensor(out) and out.shape[0] == sum(len(tokens) for _, tokens in requests)
                assert text.layers_to_capture == []  # restored after each forward
            decode = text(*pack([("eagle3-x", foreign[:1])], StandinForwardMode.DECODE))  # not a stage-02 id
            assert torch.is_tensor(decode)
    finally:
        hooks.remove()
    assert not hasattr(SGLangStyleTextModel.forward, "__eagle3_capture__")
    hooks._sink.close()

    out = plan.folder
    assert scan_output(out, samples, clean=False) == set(range(len(samples)))
    assert sorted(int(x) for x in (out / JOURNAL_FILE).read_text().split()) == list(range(len(samples)))
    assert json.loads((out / ACTIVE_FILE).read_text())["text_model"] == "SGLangStyleTextModel"
    assert not (out / ERROR_FILE).exists()
    for sample in samples:
        with torch.no_grad():
            reference = model(input_ids=sample.input_ids[None], output_hidden_states=True)
        hidden, logits = [h[0] for h in reference.hidden_states], reference.logits[0]
        files = {name: torch.load(out / sample.rel_path / name, weights_only=True) for name in SAMPLE_FILES}
        alone = sample.position == 0  # the only sample whose forward held it alone
        for k, layer in enumerate(layers):
            if alone:
                assert torch.equal(files[AUX_FILES[k]], hidden[layer]), (which, layer)
            else:
                torch.testing.assert_close(files[AUX_FILES[k]], hidden[layer], rtol=1e-5, atol=1e-5)
        final = files[FINAL_FILE]
        if alone:
            assert torch.equal(final, hidden[-1])
        torch.testing.assert_close(model.lm_head(final), logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(files[META_FILE]["input_ids"], sample.input_ids)
        assert torch.equal(files[META_FILE]["loss_mask"], sample.loss_mask)


def test_capture_refuses_nonfinite_states_naming_the_sample_and_layer(verifiers, tmp_path):
    """NaN in the residual stream of one packed request: the hooks stop before writing anything of the batch and
    name that request's sample and the first captured layer that holds it, as the hf backend does."""
    from eagle3_pipeline.verifier.capture import find_text_model

    model, text, samples, plan = _setup(verifiers["stories"], tmp_path, [1, 2, 3], [8, 6])
    hooks = CaptureHooks([1, 2, 3], plan.open_writer, on_error=plan.record_error).install(SGLangStyleTextModel)

    def poison_second_request(module, args, output):  # layer 1's MLP feeds the input of layer 2 (aux_1.pt)
        output[0, 8:] = float("nan")  # the rows of the second packed request
        return output

    handle = find_text_model(model).layers[1].mlp.register_forward_hook(poison_second_request)
    try:
        with torch.no_grad(), pytest.raises(CaptureError, match="NaN or inf") as caught:
            text(*pack([(sample_rid(0), samples[0].input_ids), (sample_rid(1), samples[1].input_ids)]))
    finally:
        handle.remove()
        hooks.remove()
    message = str(caught.value)
    assert f"{samples[1].id!r}: first in the input of decoder layer 2 (aux_1.pt)" in message
    assert repr(samples[0].id) not in message
    hooks._sink.close()
    assert not any(plan.folder.glob("shard_*/*/aux_0.pt"))  # nothing of the batch reached the disk
    assert "NaN or inf" in (plan.folder / ERROR_FILE).read_text()


def test_capture_refuses_forwards_that_are_not_one_row_per_prompt_token(verifiers, tmp_path):
    model, text, samples, plan = _setup(verifiers["stories"], tmp_path, [1, 2, 3], [8, 8, 5])
    hooks = CaptureHooks([1, 2, 3], plan.open_writer, on_error=plan.record_error).install(SGLangStyleTextModel)
    error_file = plan.folder / ERROR_FILE
    try:
        with torch.no_grad():
            # part of the prompt from the prefix cache (or a later chunk of chunked prefill)
            with pytest.raises(CaptureError, match="disable_radix_cache=True and chunked_prefill_size=-1"):
                text(*pack([(sample_rid(0), samples[0].input_ids)], prefixes=[3]))
            assert "prefix cache" in error_file.read_text()
            # a mixed batch as 0.5.23's model sees it (run as EXTEND): a stage-02 request's one-token decode
            # tail after its cached prompt is refused by the prefix check
            with pytest.raises(CaptureError, match="8 of its tokens were not recomputed"):
                text(*pack([(sample_rid(1), samples[1].input_ids), (sample_rid(0), samples[0].input_ids[-1:])],
                           prefixes=[0, 8]))
            # a decode forward of a stage-02 request (prefill-only requests never decode)
            with pytest.raises(CaptureError, match="prefill-only"):
                text(*pack([(sample_rid(0), samples[0].input_ids[-1:])], StandinForwardMode.DECODE))
            # a mixed batch as 0.5.17 hands it to the model, still marked MIXED
            with pytest.raises(CaptureError, match=r"a MIXED forward.*enable_mixed_chunk=False"):
                text(*pack([(sample_rid(1), samples[1].input_ids)], StandinForwardMode.MIXED))
            # a request whose id names another sample (same length, other tokens)
            with pytest.raises(CaptureError, match="token ids differ"):
                text(*pack([(sample_rid(1), samples[0].input_ids)]))
            with pytest.raises(CaptureError, match="5 in the prepared data"):
                text(*pack([(sample_rid(2), samples[0].input_ids)]))
            # the capture list already in use (a drafter's)
            text.layers_to_capture = [4]
            with pytest.raises(CaptureError, match="speculative"):
                text(*pack([(sample_rid(0), samples[0].input_ids)]))
            text.layers_to_capture = []
            # forwards without stage-02 requests run untouched, whatever their mode
            text(*pack([("other", samples[0].input_ids)], StandinForwardMode.MIXED))
    finally:
        hooks.remove()
        if hooks._sink is not None:
            hooks._sink.close()
    with pytest.raises(ValueError, match="ascending"):
        CaptureHooks([3, 1, 2], plan.open_writer)


def test_the_prepared_data_is_read_when_the_model_is_built_not_in_the_first_forward(verifiers, tmp_path):
    """Rank 0 reads the prepared data while SGLang loads the weights: the reader starts when a hooked text model is
    constructed (torch.distributed is up by then in SGLang's ModelRunner) and is done before the first forward, so a
    large dataset never holds a forward while the other ranks wait in NCCL."""
    import threading

    model, _, samples, plan = _setup(verifiers["stories"], tmp_path, [1, 2, 3], [8, 5, 6])
    reads = []

    def open_writer():
        reads.append(threading.current_thread().name)
        return plan.open_writer()

    hooks = CaptureHooks([1, 2, 3], open_writer, on_error=plan.record_error).install(SGLangStyleTextModel)
    try:
        from eagle3_pipeline.verifier.capture import find_text_model

        text = SGLangStyleTextModel(find_text_model(model).base)  # as SGLang builds the model, before any forward
        assert hooks.wait_ready(timeout=60)
        assert reads == ["eagle3-read-prepared-data"]  # in the reader thread, once
        assert len(hooks._sink.samples) == len(samples)
        with torch.no_grad():
            text(*pack([(sample_rid(0), samples[0].input_ids)]))
        assert reads == ["eagle3-read-prepared-data"]  # the forward used the sink already made
        # a rank that does not write never reads
        other = CaptureHooks([1, 2, 3], open_writer, is_writer=lambda: False)
        other.start_reader()
        assert not other.wait_ready(timeout=1) and len(reads) == 1
    finally:
        hooks.remove()
        if hooks._sink is not None:
            hooks._sink.close()
    assert "__eagle3_capture__" not in vars(SGLangStyleTextModel.__init__)
    # SGLang builds the model after torch.distributed is up: test_sglang_builds_the_model_after_torch_distributed


def test_the_hooks_refuse_an_sglang_other_than_the_one_stage02_checked(tmp_path, monkeypatch):
    """In SGLang's processes the hooks take the release table stage 02 chose; a different SGLang there (another
    Python environment) is named in the error file before anything is hooked."""
    from patches.sglang_capture import PLAN_ENV, install_from_environment

    plan = CapturePlan(output_dir=str(tmp_path), prepared_data=str(tmp_path / "none.jsonl"), vocab_size=512,
                       max_seq_len=2048, aux_layers=[1, 2, 3], dtype="float32", num_workers=1,
                       sglang_version="0.0.1", sglang_release=NEWEST.version)
    plan.write()
    monkeypatch.setenv(PLAN_ENV, str(plan.path))
    with pytest.raises(ImportError, match=r"run SGLang .*, but stage 02 checked 0\.0\.1"):
        install_from_environment()
    assert "stage 02 checked 0.0.1" in (tmp_path / ERROR_FILE).read_text()


def test_journal_follower_and_request_order(tmp_path):
    from eagle3_pipeline.formats.prepared_data import Sample
    from eagle3_pipeline.extract.sglang_backend import JournalFollower, request_chunks

    path = tmp_path / JOURNAL_FILE
    follower = JournalFollower(path)
    assert follower.poll() == []
    path.write_text("3\n1\n4")  # the last line is still being written
    assert follower.poll() == [3, 1]
    with open(path, "a") as handle:
        handle.write("\n1\n5\n")
    assert follower.poll() == [4, 5] and follower.done == {1, 3, 4, 5}
    samples = [Sample(i, f"s{i}", torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.uint8))
               for i, n in enumerate([5, 30, 12, 30, 1, 8])]
    chunks = request_chunks(samples, [0, 1, 2, 3, 5], batch_size=1)
    assert [i for chunk in chunks for i in chunk] == [1, 3, 2, 5, 0]  # longest first, ties in data order
    assert all(len(chunk) <= 8 for chunk in chunks)


# --- stage 02's preflight -------------------------------------------------------------------------------------------

def test_stage02_backend_sglang_refuses_before_any_engine_starts(stories260k, tmp_path):
    """Whatever SGLang is installed here (a checked release, none, another), the stage stops with exit code 2 and
    a message naming the fix, before reading the data or starting an engine."""
    import importlib.util

    from eagle3_pipeline.extract.sglang_backend import check_sglang_verifier
    from eagle3_pipeline.verifier.loading import read_verifier_info

    spec = importlib.util.spec_from_file_location("stage02_sglang", REPO / "02_extract_hidden_states.py")
    stage02 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage02)
    base = ["--model-path", str(stories260k), "--prepared-data", str(tmp_path / "none.jsonl"), "--backend", "sglang"]

    def refused(out: Path, *extra: str) -> str:
        assert stage02.main(base + ["--output-dir", str(out), *extra]) == 2
        log = (out / "logs" / "02_extract_hidden_states.log").read_text()
        assert "starting SGLang" not in log
        return log

    problem = version_problem(patches.installed_sglang_version())
    if problem is not None:
        assert problem in refused(tmp_path / "o0")
    else:
        assert "leave --device at auto" in refused(tmp_path / "o1", "--device", "cpu")
        if not torch.cuda.is_available():
            assert "--tp-size 8 needs 8 GPUs, 0 visible" in refused(tmp_path / "o2", "--tp-size", "8")
    # The verifier's architecture must be one whose text model the hooks cover.
    info = read_verifier_info(str(stories260k), with_tokenizer_hash=False)
    check_sglang_verifier(str(stories260k), info)
    info.architecture = "Qwen2ForCausalLM"
    with pytest.raises(UsageError, match="KimiK25ForConditionalGeneration.*Qwen2ForCausalLM"):
        check_sglang_verifier("qwen", info)


# --- scripts/check_sglang_capture.py: the agreement it promises ------------------------------------------------------

def _hidden_states_folder(folder: Path, samples, tensors) -> Path:
    """A finished stage-02 output holding `tensors[i]` (aux_0, aux_1, aux_2, final) for sample i."""
    from eagle3_pipeline.extract.writer import write_samples
    from eagle3_pipeline.formats.hidden_states import write_index
    from eagle3_pipeline.formats.manifest import Manifest

    folder.mkdir(parents=True)
    write_samples(folder, samples, tensors)
    write_index(folder, samples, range(len(samples)))
    Manifest(folder, "02_extract_hidden_states", {}).complete()
    return folder


def test_check_script_needs_cosine_above_0999_per_file_and_names_the_worst(tmp_path):
    import importlib.util

    from eagle3_pipeline.formats.prepared_data import read_prepared_data

    spec = importlib.util.spec_from_file_location("check_sglang_capture", REPO / "scripts" / "check_sglang_capture.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.MIN_COSINE == 0.999
    samples, _ = read_prepared_data(_prepared(tmp_path / "data", [12, 7, 9]), 512, 2048)
    generator = torch.Generator().manual_seed(0)
    reference = [[torch.randn(s.num_tokens, 64, generator=generator) for _ in range(4)] for s in samples]

    def noisy(scale: float, which: tuple[int, int]):
        """The reference with noise of relative size `scale` added to one file (sample, tensor)."""
        out = [[t.clone() for t in files] for files in reference]
        tensor = out[which[0]][which[1]]
        tensor += scale * torch.randn(tensor.shape, generator=generator)
        return out

    hf = _hidden_states_folder(tmp_path / "hf", samples, reference)
    # cosine ~0.9999 in one file: agrees
    close = check.compare(hf, _hidden_states_folder(tmp_path / "close", samples, noisy(0.01, (2, 3))))
    assert check.agrees(close)
    assert close["worst_file"]["file"] == f"{samples[2].rel_path}/final.pt"
    # cosine ~0.995 in one file (enough for the old 0.99 threshold): does not agree, and that file is named
    far = check.compare(hf, _hidden_states_folder(tmp_path / "far", samples, noisy(0.1, (1, 1))))
    assert 0.99 < far["worst_file"]["cosine"] < 0.999
    assert not check.agrees(far)
    assert far["worst_file"]["file"] == f"{samples[1].rel_path}/aux_1.pt"
    assert far["worst_file"]["sample"] == samples[1].id
    assert far["files"]["aux_1.pt"]["worst_file"] == far["worst_file"]["file"]
    assert far["files"]["aux_0.pt"]["min_cosine"] > 0.9999  # untouched files compare equal


# --- stage 02 with the engine in a supervised process (the stand-in engine) ----------------------------------------

STANDIN_GPU_BYTES = 80 * 2**30


@pytest.fixture
def standin_engine(installed_checked_sglang, monkeypatch):
    """Stage 02 --backend sglang with tests/sglang_standin.StandinEngine in its engine process. Stand-ins (no GPU
    here): the engine, one visible GPU of 80 GiB. Everything else (preflight, plan, supervision, hooks, writer,
    manifest) is the stage's own."""
    from eagle3_pipeline.extract import sglang_backend
    from eagle3_pipeline.verifier import sglang_engine

    monkeypatch.setattr(sglang_engine, "SGLANG_ENGINE", "sglang_standin:StandinEngine")
    monkeypatch.setattr(sglang_backend, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(sglang_backend, "gpu_memory_bytes", lambda: STANDIN_GPU_BYTES)
    for name in ("SGLANG_EXTERNAL_MODEL_PACKAGE", "EAGLE3_SGLANG_CAPTURE_PLAN", "PYTHONPATH"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # the stage sets them; restored afterwards
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from test_extract import stage02, write_prepared_data

    return stage02, write_prepared_data


def test_stage02_sglang_run_through_the_supervised_engine_process(standin_engine, stories260k, tmp_path,
                                                                  monkeypatch):
    from eagle3_pipeline.formats.hidden_states import open_hidden_states
    from eagle3_pipeline.extract import sglang_backend

    import sglang_standin
    from patches.sglang_capture import PLAN_ENV

    assert sglang_standin.PLAN_ENV == PLAN_ENV
    stage02, write_prepared_data = standin_engine
    data = write_prepared_data(tmp_path / "data", stories260k, [30, 12, 7, 25, 9, 16])
    out = tmp_path / "out"
    argv = ["--model-path", str(stories260k), "--prepared-data", str(data), "--output-dir", str(out),
            "--backend", "sglang", "--max-tokens-per-batch", "40", "--batch-size", "4"]
    # on a GPU too small for the weights once the capture's buffers are set aside: refused before anything starts
    monkeypatch.setattr(sglang_backend, "gpu_memory_bytes", lambda: 2**20)
    assert stage02.main(argv) == 2
    log = (out / "logs" / "02_extract_hidden_states.log").read_text()
    assert "leaves SGLang no room: the weights take about" in log and "starting SGLang" not in log
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(sglang_backend, "gpu_memory_bytes", lambda: STANDIN_GPU_BYTES)
    assert stage02.main(argv) == 0
    manifest, entries = open_hidden_states(out)
    assert manifest["status"] == "complete" and len(entries) == 6
    memory = manifest["last_run"]["capture_memory"]
    assert memory["tokens"] == 40 and memory["requested"] == 0.85
    # the aux of 3 layers and the gather of 4 tensors, hidden 64, bf16; the fraction lowered by their share
    assert memory["aux_bytes"] == 40 * 3 * 64 * 2 and memory["gather_bytes"] == 40 * 4 * 64 * 2
    assert memory["mem_fraction_static"] == 0.849  # (0.85 - 35840 / 80 GiB) rounded down to 1/1000
    log = (out / "logs" / "02_extract_hidden_states.log").read_text()
    assert "GPU memory: capture buffers outside SGLang's memory plan" in log and "mem_fraction_static=0.849" in log


@pytest.mark.parametrize("installed,flag", [("0.5.17", []), ("0.5.22", ["--allow-untested-sglang"])])
def test_stage02_runs_each_release_with_its_own_settings(standin_engine, stories260k, tmp_path, monkeypatch,
                                                         installed, flag):
    """With 0.5.17 installed the engine gets 0.5.17's settings (the stand-in refuses any name that release's
    ServerArgs lacks, read from its source); an untested release runs only with --allow-untested-sglang, warned,
    with the newest checked release's settings. The manifest records the version and the release table used."""
    from eagle3_pipeline.formats.files import read_json

    release = release_for(installed)
    src.release_source(release.version)  # what the stand-in checks the settings against (skips when absent)
    stage02, write_prepared_data = standin_engine
    _fake_installed(monkeypatch, installed)
    data = write_prepared_data(tmp_path / "data", stories260k, [12, 7, 9])
    out = tmp_path / "out"
    argv = ["--model-path", str(stories260k), "--prepared-data", str(data), "--output-dir", str(out),
            "--backend", "sglang", "--max-tokens-per-batch", "32", "--batch-size", "2"]
    log_file = out / "logs" / "02_extract_hidden_states.log"
    if flag:
        assert stage02.main(argv) == 2
        assert version_problem(installed) in log_file.read_text() and not (out / "manifest.json").exists()
    assert stage02.main(argv + flag) == 0
    last_run = read_json(out / "manifest.json")["last_run"]
    assert last_run["sglang_version"] == installed and last_run["sglang_release"] == release.version
    log = log_file.read_text()
    assert all(f"{name}={value}" in log for name, value in release.capture_settings.items())
    assert ("is not a release the capture hooks are checked against" in log) == bool(flag)


def test_stage02_reports_a_hooks_failure_in_the_engine_process_and_resumes(standin_engine, stories260k, tmp_path,
                                                                          monkeypatch):
    """The hooks fail in the third forward; SGLang's way of answering that (the engine's process is killed) ends
    the child, not stage 02, which exits 1 naming the hooks' error file, the samples kept and the resume command,
    and marks its manifest failed. The printed command then finishes the run."""
    import shlex

    from eagle3_pipeline.formats.files import read_json
    from eagle3_pipeline.formats.hidden_states import open_hidden_states
    from sglang_standin import FAIL_AT_ENV

    stage02, write_prepared_data = standin_engine
    data = write_prepared_data(tmp_path / "data", stories260k, [30, 28, 26, 12, 9, 7, 5])
    out = tmp_path / "out"
    argv = ["--model-path", str(stories260k), "--prepared-data", str(data), "--output-dir", str(out),
            "--backend", "sglang", "--max-tokens-per-batch", "32", "--batch-size", "2"]
    monkeypatch.setenv(FAIL_AT_ENV, "2")  # forwards 0 and 1 (samples 0 and 1) are written first
    assert stage02.main(argv) == 1
    log = (out / "logs" / "02_extract_hidden_states.log").read_text()
    assert "SGLang's engine process" in log and "was killed by signal 9" in log
    assert f"the capture hooks' error file {out / ERROR_FILE}" in log
    assert "were not recomputed (prefix cache or chunked prefill)" in log  # the hooks' own error, from the file
    manifest = read_json(out / "manifest.json")
    assert manifest["status"] == "failed"
    failure = manifest["failure"]
    assert failure["hooks_error_file"] == str(out / ERROR_FILE) and failure["samples"] == 7
    assert failure["complete_samples"] == 2
    assert "2 of 7 samples are complete on disk and are kept; resume with:" in log
    assert failure["resume_command"] in log
    # the resume command, as printed, finishes the run and keeps the two samples already written
    monkeypatch.delenv(FAIL_AT_ENV)
    kept = {p: p.stat().st_mtime_ns for p in out.glob("shard_*/*/final.pt")}
    assert len(kept) == 2
    resume = shlex.split(failure["resume_command"])
    assert resume[:2] == ["python", "02_extract_hidden_states.py"] and "--overwrite" not in resume
    assert stage02.main(resume[2:]) == 0
    manifest, entries = open_hidden_states(out)
    assert manifest["status"] == "complete" and len(entries) == 7 and "failure" not in manifest
    assert {p: p.stat().st_mtime_ns for p in kept} == kept


def test_capture_memory_for_kimi_is_taken_off_the_memory_fraction_or_refused():
    from eagle3_pipeline.extract.sglang_backend import capture_memory

    gpu = 96 * 2**30  # an SM120 RTX PRO 6000 of the Kimi deployment
    weights = 547 * 10**9 // 8  # Kimi-K2.5 int4 over 8 GPUs
    memory = capture_memory(32768, 7168, 3, 2, gpu, 0.85, weights)
    assert memory.aux_bytes == 32768 * 3 * 7168 * 2 == 1_409_286_144  # ~1.4 GB on every rank
    assert memory.gather_bytes == 32768 * 4 * 7168 * 2 == 1_879_048_192  # ~1.9 GB more on rank 0
    assert memory.mem_fraction_static == 0.818  # 0.85 - 3.29 GB / 103 GB, rounded down
    assert (0.85 - memory.mem_fraction_static) * gpu >= memory.extra_bytes  # the whole of it is left free
    assert "1.3 GB" in memory.describe() and "1.8 GB" in memory.describe()  # human_bytes (GiB)
    # too many tokens per forward for the weights to fit any more: refused, with the numbers and the fix
    with pytest.raises(UsageError, match=r"weights take about .* per GPU.*Lower --max-tokens-per-batch"):
        capture_memory(262144, 7168, 3, 2, gpu, 0.85, weights)
    with pytest.raises(UsageError, match="leaves SGLang no room"):
        capture_memory(10**6, 7168, 3, 2, gpu, 0.85)


def test_why_the_engine_runs_in_a_child_and_the_memory_plan_it_lowers(checked_sglang):
    """Each release's source behind sglang_engine.EngineProcess and CaptureMemory (docs/extraction.md): alike."""
    sg = checked_sglang
    # A scheduler's exception is answered by SIGQUIT to its parent, the process that made the Engine ...
    scheduler = src.source_of(sg.find_function("sglang.srt.managers.scheduler", "run_scheduler_process"))
    assert "parent_process = psutil.Process().parent()" in scheduler
    assert "parent_process.send_signal(signal.SIGQUIT)" in scheduler[scheduler.index("except Exception:"):]
    # ... whose handler kills its own process tree, itself included: stage 02 must not be that process.
    engine = src.source_of(sg.find_function("sglang.srt.entrypoints.engine", "_set_envs_and_config"))
    handler = engine[engine.index("def launch_phase_sigquit_handler"):]
    assert "kill_process_tree(os.getpid())" in handler
    assert "signal.signal(signal.SIGQUIT, launch_phase_sigquit_handler)" in handler
    kill = src.source_of(sg.find_function("sglang.srt.utils.common", "kill_process_tree"))
    assert "include_parent: bool = True" in kill and "itself.kill()" in kill
    # SGLang's KV budget keeps only pre_model_load_memory * (1 - mem_fraction_static) free for activations.
    budget = src.source_of(sg.find_method("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator",
                                          "_profile_available_bytes"))
    assert "slack_gb = pre_model_load_memory * (1 - get_schedule().mem_fraction_static)" in budget
