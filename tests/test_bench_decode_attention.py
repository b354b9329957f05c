"""scripts/lab/bench_decode_attention.py on a CPU: every way of computing a decoding step's attention over a
left-padded cache (SDPA's GQA, folded GQA heads, plain matmuls, multiplies and sums, the Triton kernel in
Triton's interpreter, FlexAttention) gives the result of transformers' repeat-the-heads way."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lab" / "bench_decode_attention.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_decode_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("heads", ["--heads 9 --kv-heads 3 --head-dim 64", "--heads 8 --kv-heads 8 --head-dim 32"])
def test_every_way_equals_repeating_the_heads(heads, capsys):
    # FlexAttention compiles (about 15 s a shape on a CPU): one shape of it, in the first case only
    triton = ",triton" if importlib.util.find_spec("triton") else ""  # Triton's interpreter (tests/conftest.py)
    ways = "repeat,gqa,folded,matmul,reduce" + triton + (",flex" if "--heads 9" in heads else "")
    rows = load_script().main(["--shapes", "5x40" if "flex" in ways else "5x40,3x72", "--iters", "1", "--device",
                               "cpu", "--dtype", "float32", "--ways", ways, *heads.split()])
    assert [row["way"] for row in rows] == ways.split(",") * (1 if "flex" in ways else 2)
    assert all(row["max_abs_diff"] < 1e-5 for row in rows), rows
    assert "| 5x40 | matmul |" in capsys.readouterr().out


def test_the_compiled_reduce_way_equals_repeating_the_heads(capsys):
    """--compile, as the loop engine runs the step: inductor's fused reductions keep the result."""
    rows = load_script().main(["--shapes", "5x40", "--iters", "1", "--device", "cpu", "--dtype", "float32",
                               "--ways", "reduce", "--compile"])
    assert [row["way"] for row in rows] == ["repeat", "reduce"]
    assert all(row["max_abs_diff"] < 1e-5 for row in rows), rows
    assert "compiled" in capsys.readouterr().out


def test_the_triton_sweep_times_every_option_and_keeps_the_result(capsys):
    """--triton-sweep: each combination of the kernel's options (in Triton's interpreter here) gives the
    reference result."""
    pytest.importorskip("triton", reason="Triton is not installed (requirements-test.txt installs it)")
    rows = load_script().main(["--shapes", "2x40", "--iters", "1", "--device", "cpu", "--dtype", "float32",
                               "--ways", "triton", "--triton-sweep"])
    swept = [row for row in rows if row["way"].startswith("triton b")]
    assert len(swept) == 3 * 2 * 3 * 3 and len({row["way"] for row in swept}) == len(swept)
    assert all(row["max_abs_diff"] < 1e-5 for row in rows), rows
    assert "| 2x40 | triton b64 masked w4 s- |" in capsys.readouterr().out
