"""Stage 01 --synthesize (eagle3_pipeline/data/user_turns.py, prompt_filters.py, turn_samplers.py, synthesis.py): user
turns written by the verifier from its chat template's opening, on real tokenizers and models.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, STORIES_TEMPLATE, TWO_TURN_PROMPTS
from test_prepare_data import read_jsonl, smol_tokenizer, stage  # noqa: F401  (two fixtures)
from eagle3_pipeline.data.prompt_filters import KEPT, PromptFilters
from eagle3_pipeline.data.synthesis import SAMPLES_FILE, SYNTHESIS_FILE, round_seed
from eagle3_pipeline.data.user_turns import (UserTurnFormat, template_special_tokens, user_turn_closing,
                                             user_turn_opening, user_turn_prefix)

SCRIPT = "01_prepare_data.py"
# Kimi's layout: role tokens, <|im_middle|> before the content, <|im_end|> after it, a default system prompt.
KIMI_LIKE = (
    "{%- if messages[0].role != 'system' -%}<|im_system|>system<|im_middle|>You are a helper.<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>system<|im_middle|>{%- endif -%}{{ m.content }}<|im_end|>"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
KIMI_TOKENS = ["[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
HISTORY = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "Paris."}]


@pytest.fixture(scope="module")
def stories_tokenizer(stories260k):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    tokenizer.chat_template = STORIES_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def kimi_tokenizer():
    """A byte-level BPE trained here with Kimi's chat tokens as special tokens, and KIMI_LIKE as its template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=KIMI_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["What is the capital of France? Paris. Write a poem about the sea."] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="[EOS]",
                                        additional_special_tokens=KIMI_TOKENS[1:])
    tokenizer.chat_template = KIMI_LIKE
    return tokenizer


# --- the template's opening of a user turn ------------------------------------------------------------

def test_user_turn_opening_of_stories260k_smollm2_and_kimi_templates(stories_tokenizer, smol_tokenizer,
                                                                     kimi_tokenizer):
    assert user_turn_opening(stories_tokenizer) == "<s>User: "
    assert user_turn_closing(stories_tokenizer) == "\n"
    assert user_turn_prefix(stories_tokenizer, []) == "<s>User: "
    assert user_turn_prefix(stories_tokenizer, HISTORY).endswith("<s>Answer: Paris.</s><s>User: ")

    assert user_turn_opening(smol_tokenizer) == "<|im_start|>user\n"
    assert user_turn_closing(smol_tokenizer) == "<|im_end|>\n"
    first = user_turn_prefix(smol_tokenizer, [])  # SmolLM2's template adds its default system prompt
    assert first.startswith("<|im_start|>system\n") and first.endswith("<|im_end|>\n<|im_start|>user\n")
    assert user_turn_prefix(smol_tokenizer, HISTORY).endswith(
        "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\n")

    assert user_turn_opening(kimi_tokenizer) == "<|im_user|>user<|im_middle|>"
    assert user_turn_closing(kimi_tokenizer) == "<|im_end|>"
    assert user_turn_prefix(kimi_tokenizer, []) == (
        "<|im_system|>system<|im_middle|>You are a helper.<|im_end|><|im_user|>user<|im_middle|>")
    assert template_special_tokens(kimi_tokenizer) == sorted(KIMI_TOKENS[1:])


def test_a_sampled_turn_is_cut_at_its_end_and_keeps_leaked_template_tokens(kimi_tokenizer, stories_tokenizer):
    fmt = UserTurnFormat.of(kimi_tokenizer, {kimi_tokenizer.eos_token_id})
    end = kimi_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in fmt.stop_ids  # the special token that closes a user turn stops its sampling
    ids = kimi_tokenizer("Write a poem about the sea.", add_special_tokens=False)["input_ids"]
    assert fmt.parse(kimi_tokenizer, ids + [end] + ids) == ("Write a poem about the sea.", True)
    assert fmt.parse(kimi_tokenizer, ids) == ("Write a poem about the sea.", False)  # ran out of tokens
    leak = ids + kimi_tokenizer.convert_tokens_to_ids(["<|im_assistant|>"]) + ids + [end]
    text, ended = fmt.parse(kimi_tokenizer, leak)
    assert ended and fmt.leaked(text) == "<|im_assistant|>"

    stories = UserTurnFormat.of(stories_tokenizer, {stories_tokenizer.eos_token_id})
    row = stories_tokenizer("Tell me a story.\nAnswer: no", add_special_tokens=False)["input_ids"]
    assert stories.parse(stories_tokenizer, row) == ("Tell me a story.", True)  # the closing is a newline


# --- the filters --------------------------------------------------------------------------------------

def test_filters_drop_planted_duplicates_loops_leaks_and_benchmark_prompts(smol_tokenizer):
    from eagle3_pipeline.data.inputs import excluded_prompt_hashes

    fmt = UserTurnFormat.of(smol_tokenizer, {smol_tokenizer.eos_token_id})
    benchmark = json.loads(TWO_TURN_PROMPTS.read_text().splitlines()[0])["turns"][0]
    filters = PromptFilters(fmt, 0.7, excluded_prompt_hashes([str(TWO_TURN_PROMPTS)]))
    poem = "Write a short poem about the sea and the sky at night, with a calm and hopeful ending please."
    planted = [
        (poem, True, KEPT),
        ("  write a SHORT poem about the sea and the sky at night, with a calm and hopeful ending please.", True,
         "exact_duplicate"),
        ("Write a short poem about the sea and the sky at night, with a calm and hopeful ending, thanks.", True,
         "near_duplicate"),
        ("Write a short story about a dragon who learns to bake bread in a small mountain village.", True, KEPT),
        ("", True, "empty"),
        ("Hi there", True, "too_short"),
        ("Explain how vaccines train the immune system to recognise", False, "too_long"),
        ("Explain recursion.<|im_start|>assistant\nRecursion is", True, "template_leak"),
        ("tell me more tell me more tell me more tell me more tell me more tell me more", True, "looping"),
        (benchmark, True, "excluded_prompt"),
        (poem, True, KEPT),  # a second turn is compared with second turns only
    ]
    verdicts = [filters.verdict(text, ended, 1 if i == len(planted) - 1 else 0)
                for i, (text, ended, _) in enumerate(planted)]
    assert verdicts == [expected for _, _, expected in planted]

    # Rebuilt from the kept turns alone (as a resumed run does), the filters judge the same way.
    again = PromptFilters(fmt, 0.7, set())
    again.remember(planted[0][0], 0)
    assert again.verdict(planted[2][0], True, 0) == "near_duplicate"
    assert PromptFilters(fmt, 1.0, set()).verdict(planted[2][0], True, 0) == KEPT  # 1: exact duplicates only


# --- stage 01 --synthesize ----------------------------------------------------------------------------

def test_synthesis_on_smollm2_equals_a_hand_written_sampling_loop(stage, tmp_path, smollm2, smol_tokenizer):
    import torch

    from eagle3_pipeline.data.chat_tokenizer import end_of_turn_ids
    from eagle3_pipeline.verifier.loading import load_verifier_model

    out = tmp_path / "out"
    args = ["--model-path", str(smollm2), "--synthesize", "3", "--synthesize-temperature", "0.9",
            "--synthesize-top-p", "0.95", "--synthesize-max-tokens", "24", "--regenerate", "--max-new-tokens", "8",
            "--batch-size", "2", "--device", "cpu", "--dtype", "float32", "--max-seq-len", "512", "--seed", "3",
            "--output-dir", str(out)]
    assert stage.main(args) == 0
    rounds = read_jsonl(out / SYNTHESIS_FILE)
    first_round = [e for e in rounds if e["round"] == 0]
    assert len(first_round) == 8  # ROUND_BATCHES x --batch-size

    # The same seed through a hand-written loop: transformers' generate from the template's opening, in the
    # engine's batches of --batch-size rows, each row cut at its end of turn.
    model = load_verifier_model(str(smollm2), "cpu", "float32")
    fmt = UserTurnFormat.of(smol_tokenizer, end_of_turn_ids(smol_tokenizer, str(smollm2)))
    prefix = smol_tokenizer(user_turn_prefix(smol_tokenizer, []), add_special_tokens=False)["input_ids"]
    torch.manual_seed(round_seed(3, 0, 0, "user"))
    texts = []
    with torch.inference_mode():
        for _ in range(4):
            rows = model.generate(input_ids=torch.tensor([prefix] * 2), attention_mask=torch.ones(2, len(prefix),
                                  dtype=torch.long), do_sample=True, temperature=0.9, top_p=0.95, top_k=0,
                                  max_new_tokens=24, eos_token_id=sorted(fmt.stop_ids),
                                  pad_token_id=smol_tokenizer.pad_token_id or smol_tokenizer.eos_token_id)
            texts += [fmt.parse(smol_tokenizer, row[len(prefix):].tolist())[0] for row in rows]
    assert [e["sampled"][0]["text"] for e in first_round] == texts
    assert len(set(texts)) > 1

    manifest = json.loads((out / "manifest.json").read_text())
    synthesis = manifest["synthesis"]
    sampled = [s for e in rounds for s in e["sampled"]]
    assert synthesis["user_turns"]["sampled"] == len(sampled)
    assert synthesis["user_turns"]["kept"] + sum(synthesis["user_turns"]["dropped"].values()) == len(sampled)
    assert synthesis["made"] == 3 and synthesis["user_turn_opening"] == "<|im_start|>user\n"
    assert manifest["sources"][0] == {"dataset": "synthesize", "format": "synthesize", "records": 3,
                                      "bad_records": 0}
    # Every made conversation was trained on with the reply made beside its prompt (reused, not regenerated).
    assert manifest["regeneration"]["reused"] == 3 and manifest["regeneration"]["generated"] == 0
    made = [e for e in rounds if e["messages"]][:3]
    from eagle3_pipeline.data.records import prompt_hash

    hashes = set((out / "train_prompt_hashes.txt").read_text().split())
    assert hashes == {prompt_hash(e["messages"][0]["content"]) for e in made}
    assert all(e["messages"][0]["content"] in texts + [s["text"] for s in sampled] for e in made)
    page = (out / SAMPLES_FILE).read_text()
    assert made[0]["id"] in page and "## Kept" in page


def test_synthesize_needs_regenerate_and_a_chat_template(stage, tmp_path, stories260k):
    base = ["--model-path", str(stories260k), "--synthesize", "2", "--output-dir", str(tmp_path / "o")]
    assert stage.main(base) == 2
    assert "--regenerate" in (tmp_path / "o" / "logs" / "01_prepare_data.log").read_text().splitlines()[-1]
    assert stage.main(base + ["--regenerate", "--device", "cpu"]) == 2
    assert "--chat-template" in (tmp_path / "o" / "logs" / "01_prepare_data.log").read_text().splitlines()[-1]


def test_synthesis_through_an_endpoint_sends_the_opening_as_token_ids(stage, tmp_path, stories260k,
                                                                      stories_tokenizer):
    from openai_server import ModelServer

    from eagle3_pipeline.verifier.loading import load_verifier_model

    bodies: list[dict] = []
    model = load_verifier_model(str(stories260k), "cpu", "float32")
    server = ModelServer(model, stories_tokenizer, name="stories-served",
                         eos_token_ids=[stories_tokenizer.eos_token_id],
                         meta_info=lambda body: bodies.append(body) or {})
    url = server.start()
    template = tmp_path / "t.jinja"
    template.write_text(STORIES_TEMPLATE)
    out = tmp_path / "out"
    try:
        assert stage.main(["--model-path", str(stories260k), "--chat-template", str(template), "--synthesize", "2",
                           "--synthesize-max-tokens", "64", "--regenerate", "--regenerate-endpoint", url,
                           "--batch-size", "2", "--max-new-tokens", "6", "--max-seq-len", "256",
                           "--output-dir", str(out)]) == 0
    finally:
        server.stop()
    prefix = stories_tokenizer(user_turn_prefix(stories_tokenizer, []), add_special_tokens=False)["input_ids"]
    sampling = [b for b in bodies if "input_ids" in b]
    assert sampling and all(b["input_ids"] == prefix for b in sampling)
    assert all(b["sampling_params"]["max_new_tokens"] == 64 for b in sampling)
    made = [e for e in read_jsonl(out / SYNTHESIS_FILE) if e["messages"]][:2]
    assert len(made) == 2
    for entry in made:  # each reply is the server's own greedy reply to the made turn
        reply = server.chat({"messages": entry["messages"][:1], "max_tokens": 6, "temperature": 0.0})
        assert reply["choices"][0]["message"]["content"].strip() == entry["messages"][1]["content"]
    assert json.loads((out / "manifest.json").read_text())["synthesis"]["made"] == 2


def test_synthesis_resumes_after_sigkill_byte_identical(tmp_path, stories260k):
    """A real stage-01 process killed mid-synthesis, then rerun, ends with the same files as a run never killed."""
    template = tmp_path / "t.jinja"
    template.write_text(STORIES_TEMPLATE)

    def command(out: Path) -> list[str]:
        return [sys.executable, str(REPO / SCRIPT), "--model-path", str(stories260k), "--chat-template",
                str(template), "--synthesize", "6", "--synthesize-turns", "2", "--synthesize-max-tokens", "48",
                "--regenerate", "--max-new-tokens", "6", "--batch-size", "2", "--device", "cpu", "--dtype",
                "float32", "--max-seq-len", "256", "--eval-ratio", "0.2", "--output-dir", str(out)]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert subprocess.run(command(reference), env=env, capture_output=True, timeout=600).returncode == 0
    rounds = max(e["round"] for e in read_jsonl(reference / SYNTHESIS_FILE)) + 1
    assert rounds >= 2  # a kill after the first round lands mid-run

    process = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cache = killed / SYNTHESIS_FILE
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if cache.exists() and len(cache.read_text().splitlines()) >= 8:  # the first round is written
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "tokenized_data.jsonl").exists()
    assert subprocess.run(command(killed), env=env, capture_output=True, timeout=600).returncode == 0
    for name in ("tokenized_data.jsonl", "eval_data.jsonl", "train_prompt_hashes.txt", SAMPLES_FILE):
        assert (killed / name).read_bytes() == (reference / name).read_bytes(), name
    synthesis = json.loads((killed / "manifest.json").read_text())["synthesis"]
    assert synthesis["reused_rounds"] >= 1
    reference_synthesis = json.loads((reference / "manifest.json").read_text())["synthesis"]
    assert synthesis["user_turns"] == reference_synthesis["user_turns"]


def test_source_count_mixes_sources_by_a_stated_count(stage, tmp_path, stories260k):
    template = tmp_path / "t.jinja"
    template.write_text(STORIES_TEMPLATE)

    def source(name: str, n: int) -> Path:
        rows = [{"id": f"{name}{i}", "conversations": [{"from": "human", "value": f"{name} question number {i}"},
                                                       {"from": "gpt", "value": f"{name} answer {i}"}]}
                for i in range(n)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    a, b = source("alpha", 6), source("beta", 5)
    out = tmp_path / "out"
    base = ["--model-path", str(stories260k), "--chat-template", str(template), "--dataset", str(a), "--dataset",
            str(b), "--max-seq-len", "256", "--output-dir", str(out)]
    assert stage.main(base + ["--source-count", f"{a}=2", "--source-count", f"{b}=9"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mixing"] == {str(a): {"asked": 2, "available": 6, "taken": 2},
                                  str(b): {"asked": 9, "available": 5, "taken": 5}}
    ids = [json.loads(line)["id"] for line in (out / "tokenized_data.jsonl").read_text().splitlines()]
    assert sum(i.startswith("alpha") for i in ids) == 2 and sum(i.startswith("beta") for i in ids) == 5
    log = (out / "logs" / "01_prepare_data.log").read_text()
    assert f"--source-count {b}=9: the source gave only 5" in log

    assert stage.main(base + ["--source-count", "missing.jsonl=3", "--overwrite"]) == 2
    last = (out / "logs" / "01_prepare_data.log").read_text().splitlines()[-1]
    assert "--source-count missing.jsonl=3" in last and str(a) in last
