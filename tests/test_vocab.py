"""Stage 03 on real ShareGPT data tokenized by stage 01 with SmolLM2's tokenizer."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from eagle3_pipeline.formats.vocab_map import load_mapping, select_draft_vocab
from conftest import run_script

DRAFT = 2000


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, smollm2, sharegpt_path):
    run = tmp_path_factory.mktemp("vocab_run")
    result = run_script("01_prepare_data.py", "--run-dir", str(run), "--model-path", str(smollm2),
                        "--dataset", str(sharegpt_path), "--num-samples", "150", "--max-seq-len", "1024")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = run_script("03_build_vocab_mapping.py", "--run-dir", str(run), "--draft-vocab-size", str(DRAFT))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run


def masked_target_counts(run) -> Counter:
    counts = Counter()
    with open(run / "data" / "tokenized_data.jsonl") as handle:
        for line in handle:
            record = json.loads(line)
            counts.update(t for t, m in zip(record["input_ids"], record["loss_mask"]) if m)
    return counts


def test_mapping_semantics_on_sharegpt(run_dir):
    mapping = load_mapping(run_dir / "vocab")
    assert mapping.d2t.dtype == torch.int64 and mapping.t2d.dtype == torch.bool
    assert mapping.d2t.shape == (DRAFT,) and mapping.t2d.shape == (49152,)
    target_ids = torch.arange(DRAFT) + mapping.d2t
    assert torch.all(target_ids[1:] > target_ids[:-1]), "draft ids must be sorted by target id"
    assert mapping.t2d[target_ids].all() and int(mapping.t2d.sum()) == DRAFT  # t2d marks exactly them

    counts = masked_target_counts(run_dir)
    kept = set(target_ids.tolist())
    # Every kept token is at least as frequent as every dropped one.
    least_kept = min(counts.get(t, 0) for t in kept)
    most_dropped = max(c for t, c in counts.items() if t not in kept)
    assert least_kept >= most_dropped
    report = json.loads((run_dir / "vocab" / "vocab_report.json").read_text())
    total = sum(counts.values())
    assert report["target_tokens"] == total
    assert report["unique_target_tokens"] == len(counts)
    assert report["coverage"] == pytest.approx(sum(counts.get(t, 0) for t in kept) / total)
    assert report["least_frequent_kept"]["count"] == least_kept
    manifest = json.loads((run_dir / "vocab" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["draft_vocab_size"] == DRAFT
    assert manifest["inputs"]["prepared_data"]["manifest_sha256"]
    assert manifest["verifier"]["vocab_size"] == 49152


def test_ties_break_by_token_id():
    counts = np.array([5, 3, 3, 3, 0, 9])
    mapping = select_draft_vocab(counts, 3)
    assert (torch.arange(3) + mapping.d2t).tolist() == [0, 1, 5]


def test_identity_map_when_vocab_is_not_larger(run_dir, tmp_path):
    result = run_script("03_build_vocab_mapping.py", "--prepared-data", str(run_dir / "data"),
                        "--output-dir", str(tmp_path / "v"), "--draft-vocab-size", "60000",
                        env={"EAGLE3_COMPILE": "0", "EAGLE3_TTT_ATTENTION": ""})
    assert result.returncode == 0, result.stdout[-2000:]
    # The environment switches are recorded (here set by hand, as a user would), unset ones as null.
    environment = json.loads((tmp_path / "v" / "manifest.json").read_text())["environment"]
    assert environment["EAGLE3_COMPILE"] == "0" and environment["EAGLE3_TTT_ATTENTION"] == ""
    assert "EAGLE3_FUSE_ELEMENTWISE" in environment
    mapping = load_mapping(tmp_path / "v")
    assert mapping.d2t.shape == (49152,) and not mapping.d2t.any() and mapping.t2d.all()


def test_rerun_is_a_no_op_and_other_size_needs_overwrite(run_dir):
    before = (run_dir / "vocab" / "vocab_mapping.safetensors").stat().st_mtime_ns
    again = run_script("03_build_vocab_mapping.py", "--run-dir", str(run_dir), "--draft-vocab-size", str(DRAFT))
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert (run_dir / "vocab" / "vocab_mapping.safetensors").stat().st_mtime_ns == before
    other = run_script("03_build_vocab_mapping.py", "--run-dir", str(run_dir), "--draft-vocab-size", "1000")
    assert other.returncode == 2 and "--overwrite" in other.stdout


def test_refuses_data_of_another_tokenizer(run_dir, tmp_path, stories260k):
    result = run_script("03_build_vocab_mapping.py", "--prepared-data", str(run_dir / "data"),
                        "--output-dir", str(tmp_path / "v"), "--model-path", str(stories260k))
    assert result.returncode == 2
    assert "mismatch" in result.stdout and str(stories260k) in result.stdout
    assert not (tmp_path / "v" / "vocab_mapping.safetensors").exists()


def test_progress_is_logged_as_plain_lines_under_nohup(run_dir):
    # The fixture ran the stage with stdout to a pipe, as under nohup: no tqdm bar, plain progress lines.
    log = (run_dir / "logs" / "03_build_vocab_mapping.log").read_text()
    samples = json.loads((run_dir / "data" / "manifest.json").read_text())["counts"]["samples"]
    assert f"counting target tokens: {samples}/{samples} (100.0%), ETA 00:00" in log
    assert "\r" not in log  # no terminal control characters in the file
