"""SGLang engine settings (eagle3_pipeline/verifier/sglang_settings.py): stage 02's --attention-backend,
--sampling-backend and --sglang-arg reach sglang.Engine's keyword arguments and the manifest, are checked against the
installed release's own server_args.py before anything loads, and the serving command printed by
scripts/sglang_launch_command.py takes the same spelling. The installed release is read as text
(tests/sglang_source.py); nothing of SGLang is imported."""
from __future__ import annotations

import pytest

import sglang_source as src
from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.verifier.sglang_settings import (as_launch_arguments, chosen_settings, parse_sglang_args,
                                                      server_arg_names)


@pytest.fixture
def installed_sglang():
    """The installed SGLang's package folder (CI installs a checked release with --no-deps); skips without it."""
    return src.sglang_root()


def stage02_config(*flags: str):
    """Stage 02's settings from its own parser, with --backend sglang and these flags."""
    from test_extract import stage02_config as parsed

    return parsed("--backend", "sglang", *flags)


def test_sglang_args_are_read_as_json_values_with_underscored_names():
    settings = parse_sglang_args(["disable-cuda-graph=true", "cuda_graph_max_bs=8", "moe_runner_backend=triton",
                                  "--watchdog-timeout=600.5", "json_model_override_args={\"a\": 1}"])
    assert settings == {"disable_cuda_graph": True, "cuda_graph_max_bs": 8, "moe_runner_backend": "triton",
                        "watchdog_timeout": 600.5, "json_model_override_args": {"a": 1}}
    assert parse_sglang_args(None) == {}
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        parse_sglang_args(["disable_cuda_graph"])
    with pytest.raises(UsageError, match="sets cuda_graph_max_bs twice"):
        parse_sglang_args(["cuda_graph_max_bs=8", "cuda_graph_max_bs=16"])


def test_chosen_settings_take_the_backends_and_refuse_what_a_stage_flag_sets():
    assert chosen_settings(["grammar_backend=none"], "triton", "pytorch") == {
        "grammar_backend": "none", "attention_backend": "triton", "sampling_backend": "pytorch"}
    assert chosen_settings(None) == {}  # nothing chosen: SGLang's own defaults
    config = stage02_config("--attention-backend", "triton", "--sampling-backend", "pytorch", "--sglang-arg",
                            "grammar_backend=none")
    assert config.sglang.engine_settings() == chosen_settings(["grammar_backend=none"], "triton", "pytorch")
    with pytest.raises(UsageError, match="set it with --tp-size"):
        chosen_settings(["tp_size=8"])
    with pytest.raises(UsageError, match="set it with --attention-backend"):
        stage02_config("--sglang-arg", "attention_backend=fa3").sglang.engine_settings()


def test_engine_kwargs_carry_the_settings_and_the_installed_release_checks_their_names(installed_sglang):
    from eagle3_pipeline.extract.sglang_backend import check_engine_settings, engine_kwargs
    from patches.sglang_releases import NEWEST

    config = stage02_config("--attention-backend", "triton", "--sampling-backend", "pytorch",
                            "--sglang-arg", "grammar_backend=none", "--sglang-arg", "watchdog_timeout=600")
    kwargs = engine_kwargs(NEWEST, config, "/models/m", 64, 32768)
    assert (kwargs["attention_backend"], kwargs["sampling_backend"], kwargs["grammar_backend"],
            kwargs["watchdog_timeout"]) == ("triton", "pytorch", "none", 600)
    assert {k: kwargs[k] for k in NEWEST.capture_settings} == NEWEST.capture_settings  # the capture's own settings untouched
    names = server_arg_names(src.sglang_root())
    assert set(kwargs) <= names, set(kwargs) - names
    assert check_engine_settings(config.sglang, "installed") == config.sglang.engine_settings()
    with pytest.raises(UsageError, match=r"no server argument 'attention_backnd'.*did you mean attention_backend"):
        check_engine_settings(stage02_config("--sglang-arg", "attention_backnd=triton").sglang, "0.5.x")
    capture_setting = next(iter(NEWEST.capture_settings))
    with pytest.raises(UsageError, match=f"--sglang-arg {capture_setting}: stage 02's capture sets it itself"):
        check_engine_settings(stage02_config("--sglang-arg", f"{capture_setting}=false").sglang, "0.5.x")


def test_stage02_refuses_a_misspelled_engine_setting_before_the_verifier_loads(installed_sglang, stories260k,
                                                                             tmp_path, monkeypatch):
    """The real stage 02 script: the bad name is named with the closest real one, exit 2, nothing written but the
    log. Stand-in (no GPU here): one visible GPU."""
    from eagle3_pipeline.extract import sglang_backend
    from test_extract import stage02, write_prepared_data

    monkeypatch.setattr(sglang_backend, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(sglang_backend, "check_sglang_installed", lambda *a, **k: "installed")
    data = write_prepared_data(tmp_path / "data", stories260k, [12, 9])
    out = tmp_path / "out"
    argv = ["--model-path", str(stories260k), "--prepared-data", str(data), "--output-dir", str(out),
            "--backend", "sglang", "--sglang-arg", "sampling_backnd=pytorch"]
    assert stage02.main(argv) == 2
    log = (out / "logs" / "02_extract_hidden_states.log").read_text()
    assert "no server argument 'sampling_backnd'" in log and "did you mean sampling_backend" in log
    assert not (out / "manifest.json").exists()


def test_launch_arguments_spell_settings_as_sglang_flags():
    assert as_launch_arguments({"disable_cuda_graph": True, "enable_foo": False, "cuda_graph_max_bs": 8,
                                "sampling_backend": "pytorch", "cuda_graph_bs": [1, 2, 4]}) == \
        ["--disable-cuda-graph", "--cuda-graph-max-bs", "8", "--sampling-backend", "pytorch",
         "--cuda-graph-bs", "1", "2", "4"]


def test_launch_command_takes_the_machine_settings(installed_sglang, tmp_path):
    from test_launch_command import kimi_drafter, kimi_folder

    from eagle3_pipeline.verifier.sglang_launch import build_launch_command

    verifier = kimi_folder(tmp_path / "kimi")
    drafter = kimi_drafter(tmp_path / "d", verifier, [2, 30, 58])
    command = build_launch_command(drafter, str(verifier), tp_size=8, settings={
        "sampling_backend": "pytorch", "grammar_backend": "none", "mem_fraction_static": 0.8})
    assert command.argv[-6:] == ["--sampling-backend", "pytorch", "--grammar-backend", "none",
                                 "--mem-fraction-static", "0.8"]
    # each a command-line flag of the installed release (--sampling-backend is added by hand there: its choices
    # are computed at start-up, so its field is declared without a flag of its own)
    fields, server_args = src.server_args_fields(), src.source_of(src.parse("sglang.srt.server_args"))
    for flag in (a for a in command.argv if a.startswith("--")):
        assert fields.get(flag[2:].replace("-", "_")) or f'"{flag}"' in server_args, flag
    with pytest.raises(UsageError, match="the command sets --attention-backend"):
        build_launch_command(drafter, str(verifier), settings={"attention_backend": "fa3"})
    with pytest.raises(UsageError, match="no server argument 'grammar_backed'"):
        build_launch_command(drafter, str(verifier), settings={"grammar_backed": "none"})
