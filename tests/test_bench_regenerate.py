"""scripts/lab/bench_regenerate.py on a CPU: stories260K and a tiny Llama, every engine part but continuous batching,
with --profile; and a run of one engine alone (--static-only --engines loop)."""
from __future__ import annotations

import json

from conftest import ASSETS, run_script

STARTS = ["Once upon a time", "The dog ran to the", "Lily and Tom went to the park and saw", "A big red",
          "One day, a little girl named Sue found a shiny stone in the garden. She", "Sam had a toy",
          "The cat sat on the", "Tom saw a big", "A little bird sang", "Mom made a cake for"]
NEW_TOKENS = 8


def sharegpt_file(path):
    """ShareGPT JSON: short first turns, and every fourth long (over 128 tokens: a second padded width)."""
    story = " ".join(STARTS)
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"{s} {story} {story}" if i % 4 == 0 else s},
                                               {"from": "gpt", "value": "ok"}]}
            for i, s in enumerate(STARTS)]
    path.write_text(json.dumps(rows))
    return path


def bench(tmp_path, stories260k, out_name, *extra):
    out = tmp_path / out_name
    done = run_script("scripts/lab/bench_regenerate.py", "--model-path", str(stories260k),
                      "--chat-template", str(ASSETS / "stories260K_chat.jinja"),
                      "--data", str(sharegpt_file(tmp_path / "sharegpt.json")), "--out", str(out),
                      "--device", "cpu", "--dtype", "float32", "--max-new-tokens", str(NEW_TOKENS),
                      "--batch-size", "4", *extra, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "bench_regenerate.json").read_text()), (out / "bench_regenerate.md").read_text()


def test_bench_measures_loop_beside_static_and_profiles_them(tmp_path, stories260k):
    """Both static-cache engines run cold then warm, their float32 greedy replies equal generate's in each
    part and in the float32 check, their warm batches cover every prompt, the 8B-shaped part (tiny here)
    times a step of each, and --profile records the last warm batch's shape and its top CPU ops."""
    report, text = bench(tmp_path, stories260k, "all", "--continuous-prompts", "0", "--fp32-check-prompts", "10",
                         "--llama-shape", "tiny", "--llama-prompts", "6", "--llama-batch-size", "2", "--profile")
    for name, prompts in (("verifier", len(STARTS)), ("llama_8b_shaped", 6)):
        part = report[name]
        assert "continuous" not in part and part["generate"]["answered"] == prompts
        for engine in ("static", "loop"):
            assert part[f"{engine}_cold"]["answered"] == part[engine]["answered"] == prompts
            assert part[f"{engine}_vs_generate_replies"] == {"compared": prompts, "equal": prompts}
            batches = part[engine]["batches"]
            assert sum(b["rows"] for b in batches) == prompts and len({b["width"] for b in batches}) == 2
            assert all(1 <= b["steps"] <= NEW_TOKENS and b["cache_width"] == b["width"] + NEW_TOKENS
                       for b in batches)
            profiled = part[f"{engine}_profile"]
            assert (profiled["rows"], profiled["width"]) == (batches[-1]["rows"], batches[-1]["width"])
            assert profiled["top_by_cpu"] and profiled["top_by_device"] == [] and profiled["wall_s"] > 0
            assert f"| {name} | {engine} |" in text and f"| {name} | {engine}_cold |" in text
            assert f"{engine}, warm call, {name}" in text and f"{engine}, profile of the warm call" in text
        assert "loop_vs_static_conversations_per_s" in part["ratios"]
    assert report["fp32_vs_generate"] == {engine: {"compared": 10, "equal": 10} for engine in ("static", "loop")}
    assert report["llama_8b_shaped"]["loop_ms_per_step"] > 0 and report["llama_8b_shaped"]["static_ms_per_step"] > 0
    assert "float32 replies equal to generate's: static 10 of 10, loop 10 of 10" in text


def test_bench_runs_one_engine_alone(tmp_path, stories260k):
    """--static-only --engines loop: the loop's two calls and nothing else (no other engine, forward rate,
    float32 check or 8B-shaped part)."""
    report, text = bench(tmp_path, stories260k, "loop", "--static-only", "--engines", "loop")
    assert set(report["verifier"]) == {"loop_cold", "loop"}
    assert "fp32_vs_generate" not in report and "llama_8b_shaped" not in report
    assert "| verifier | loop |" in text and "| verifier | static |" not in text


def test_bench_runs_the_8b_shape_alone(tmp_path, stories260k):
    """--llama-only: the 8B-shaped part (tiny here) and nothing of the verifier at --model-path but its
    tokenizer."""
    report, text = bench(tmp_path, stories260k, "llama", "--llama-only", "--engines", "generate,loop",
                         "--llama-shape", "tiny", "--llama-prompts", "6", "--llama-batch-size", "2")
    assert "verifier" not in report and "fp32_vs_generate" not in report
    assert report["llama_8b_shaped"]["loop_vs_generate_replies"] == {"compared": 6, "equal": 6}
    assert "| llama_8b_shaped | loop |" in text and "| verifier | generate |" not in text


def test_differing_replies_say_where_they_part():
    """The comparison of two engines' replies counts the identical ones and, for the others, how much text
    they share before they part (a bug parts them at once; a flipped near tie somewhere along)."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_regenerate", REPO / "scripts" / "lab" / "bench_regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.same_replies(["abcdefghij", "same", "xyz", None], ["abcdeXXXXX", "same", "qrs", "unpaired"])
    assert found == {"compared": 3, "equal": 1, "differing_shared_prefix_median": 0.25,
                     "differing_within_first_5_percent": 1}
    assert module.agreement_text("loop", found) == ("loop 1 of 3 (the others share a median 25 % of their text "
                                                   "before they part; 1 part within the first 5 %)")
    assert module.same_replies(["a"], ["a"]) == {"compared": 1, "equal": 1}



def test_parting_margin_is_the_models_logit_gap_at_the_first_differing_token(stories260k):
    """Two replies that part at a token: the margin is the gap between the model's logits of the two tokens
    after the prompt and the common tokens, as a full forward over the first reply gives it; the model's
    second choice is closer than its tenth, and a pair that does not differ is not counted."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.spec_from_file_location("bench_regenerate",
                                                  ASSETS.parents[1] / "scripts" / "lab" / "bench_regenerate.py")
    bench_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_module)
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    prompt = "Once upon a time"
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0].tolist()
        logits = model(torch.tensor([greedy])).logits[0].float()
    part = len(ids) + 4  # the replies share their first 4 tokens, then take the model's first and k-th choice
    row = logits[part - 1]
    text = lambda tokens: tokenizer.decode(tokens)[len(tokenizer.decode(ids)):]  # noqa: E731
    gaps = {}
    for k in (1, 9):
        other = row.argsort(descending=True)[k].item()
        first, second = text(greedy), text(greedy[:part] + [other])
        assert list(tokenizer(prompt + second, add_special_tokens=False)["input_ids"]) == greedy[:part] + [other]
        found = bench_module.parting_margins(model, tokenizer, [prompt, prompt], [first, first], [second, first], "cpu")
        assert found["parting_checked"] == 1 and found["parting_skipped"] == 0
        assert abs(found["parting_margin_median"] - (row[greedy[part]] - row[other]).item()) < 1e-3
        gaps[k] = found["parting_margin_max"]
    assert 0 < gaps[1] < gaps[9]


def test_bench_prompts_are_a_seeded_sample_spread_over_the_file(tmp_path):
    """--num-prompts below the file's size takes a sample from the whole file, the same every run, not its
    first lines."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_regenerate",
                                                  ASSETS.parents[1] / "scripts" / "lab" / "bench_regenerate.py")
    bench_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_module)
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "ok"}]}
            for i in range(40)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(rows))
    chosen = bench_module.first_turns(str(data), 8)
    assert chosen == bench_module.first_turns(str(data), 8) and len(chosen) == 8
    numbers = sorted(int(turns[0]["content"].split()[1]) for turns in chosen)
    assert len(set(numbers)) == 8 and numbers != list(range(8)) and numbers[-1] >= 20
    assert all(turns[0]["role"] == "user" for turns in chosen)
