"""Stage 01's regeneration engines (eagle3_pipeline.data.responders.HFResponder, --regenerate-engine): static-cache
`generate`, our own decoding loop (eagle3_pipeline.data.decode_loop) and transformers' continuous batching give,
greedily in float32, the same replies token for token as plain `generate` (the first engine), on stories260K
and SmolLM2; the loop's sampling, early stop and cache reuse; several sampled replies per prompt."""
from __future__ import annotations

import pytest

from conftest import STORIES_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

PROMPTS = ["Once upon a time", "The dog ran to the", "Lily and Tom went to the park and saw", "A big red",
           "One day, a little girl named Sue found a shiny stone in the garden. She", "Sam had a toy"]


class RowRecorder:
    """Wraps HFResponder._decode to keep the raw generated token rows (cut at the first stop id)."""

    def __init__(self, responder):
        self.rows, original = [], responder._decode

        def decode(row):
            stop = next((i for i, t in enumerate(row) if t in responder.stop_ids), len(row))
            self.rows.append(list(row[:stop]))
            return original(row)

        responder._decode = decode


def replies_by_engine(model_path, tokenizer, conversations, max_new_tokens, engines, batch_size=4):
    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.verifier.loading import load_verifier_model

    model = load_verifier_model(str(model_path), "cpu", "float32")
    stop_ids = {tokenizer.eos_token_id} | ({tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None, tokenizer.unk_token_id})
    found = {}
    for engine in engines:
        responder = HFResponder(lambda _device: model, tokenizer, stop_ids, max_new_tokens, 0.0, batch_size, 512,
                                engine=engine)
        recorder = RowRecorder(responder)
        texts = responder(conversations)
        found[engine] = (texts, recorder.rows, responder.hit_max_new_tokens)
    return found


def test_plan_tokenizes_each_prompt_as_alone_and_keeps_those_within_the_budget(stories260k):
    """The responder's plan encodes all prompts in one tokenizer call: each gets the ids it gets alone, an
    unrenderable conversation None, and the batches hold the prompts under the budget, shortest first."""
    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.verifier.loading import load_tokenizer

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    conversations = [[{"role": "user", "content": text}] for text in PROMPTS]
    conversations += [[{"role": "user", "content": "once upon a time " * 60}],  # over the 64-token budget
                      []]  # nothing to render
    responder = HFResponder(lambda _device: None, tokenizer, {tokenizer.eos_token_id}, 8, 0.0, 4, 64,
                            devices=["cpu"], engine="generate")
    encoded, batches = responder.plan(conversations)
    alone = [tokenizer(responder.render(c), add_special_tokens=False)["input_ids"] for c in conversations[:-1]]
    assert encoded[:-1] == alone and encoded[-1] is None
    assert len(alone[-1]) >= 64 and all(0 < len(ids) < 64 for ids in alone[:-1])
    planned = [i for batch in batches for i in batch]
    assert sorted(planned) == list(range(len(PROMPTS)))
    assert [len(encoded[i]) for i in planned] == sorted(len(encoded[i]) for i in planned)


def test_engines_agree_token_for_token_on_stories260k(stories260k):
    from eagle3_pipeline.verifier.loading import load_tokenizer

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    conversations = [[{"role": "user", "content": text}] for text in PROMPTS]
    found = replies_by_engine(stories260k, tokenizer, conversations, 24,
                              ("generate", "static", "loop", "continuous"))
    reference = found["generate"]
    assert len(set(reference[0])) >= 4 and all(reference[0])
    for engine in ("static", "loop", "continuous"):
        assert found[engine][1] == reference[1], engine
        assert found[engine][0] == reference[0] and found[engine][2] == reference[2], engine


def test_sdpa_decode_attention_keeps_the_loop_token_for_token(smollm2, monkeypatch):
    """EAGLE3_DECODE_ATTENTION=sdpa, the folded heads in one SDPA call instead of the default matmuls (SmolLM2:
    3 query heads a K/V head): the loop's float32 greedy replies are still generate's, token for token."""
    from eagle3_pipeline.verifier.loading import load_tokenizer

    monkeypatch.setenv("EAGLE3_DECODE_ATTENTION", "sdpa")
    tokenizer = load_tokenizer(str(smollm2))
    conversations = [[{"role": "user", "content": text}] for text in
                     ["Write a haiku about rain.", "List three colours and explain why the sky looks blue."]]
    found = replies_by_engine(smollm2, tokenizer, conversations, 12, ("generate", "loop"))
    assert all(found["generate"][0]) and found["loop"][1] == found["generate"][1]


def test_engines_agree_token_for_token_on_smollm2(smollm2):
    from eagle3_pipeline.verifier.loading import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2))
    conversations = [[{"role": "user", "content": text}] for text in
                     ["What is the capital of France?", "Write a haiku about rain.", "Say hi.",
                      "List three colours and explain why the sky looks blue during the day."]]
    found = replies_by_engine(smollm2, tokenizer, conversations, 16, ("generate", "static", "loop", "continuous"))
    reference = found["generate"]
    assert all(reference[0]) and len(set(reference[0])) == 4
    for engine in ("static", "loop", "continuous"):
        assert found[engine][1] == reference[1], engine


def test_static_batches_follow_the_token_budget():
    """A "static" batch padded to width W takes floor(batch_size x (128 + new) / (W + new)) rows: with 4 rows
    and 128 new tokens, 4 rows at width 128, 2 at 256 and at 384 (exactly the budget), 1 at 512 and wider;
    prompts are packed in order, a batch closing when the next prompt would overfill it at its width."""
    from eagle3_pipeline.data.static_cache import static_batches, static_rows

    lengths = [5, 100, 128, 129, 200, 256, 257, 300, 384, 385, 512, 600]
    assert static_batches(lengths, 4, 128) == [[0, 1, 2], [3, 4], [5, 6], [7, 8], [9], [10], [11]]
    assert static_batches([10] * 9, 4, 128) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert [static_rows(width, 4, 128) for width in (128, 256, 384, 512, 4096)] == [4, 2, 2, 1, 1]
    # 1024 x 384 positions: 614 rows fit at width 384 (rounded down to 576, a multiple of 64), exactly 768 at
    # 256; 153 at 384 with a batch of 256 (under 256 rows: not rounded)
    assert [static_rows(width, 1024, 256) for width in (128, 256, 384, 1024)] == [1024, 768, 576, 256]
    assert static_rows(384, 256, 256) == 153


@pytest.mark.parametrize("engine", ["static", "loop"])
def test_static_cache_engines_size_each_cache_to_its_batch_and_reuse_it(stories260k, engine):
    """"static" and "loop" on prompts of three widths, called twice: each batch decodes with a cache as wide as
    its own padded prompts plus the new tokens (not the widest seen before), takes the rows its width's budget
    allows, and the second call reuses the pooled caches, reset in place (same tensor addresses, as CUDA
    graphs need); replies equal plain `generate`'s token for token."""
    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.data.static_cache import static_rows
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    story = " ".join(f"{PROMPTS[i % len(PROMPTS)]}." for i in range(12))  # 157 tokens with the template
    told_back = " ".join(f"{PROMPTS[-1 - i % len(PROMPTS)]}." for i in range(12))  # 157 too
    texts = PROMPTS + [story, told_back, f"{story} {story}", f"{story} {told_back}"]  # 6 under 128, 2 of 301
    first = [[{"role": "user", "content": text}] for text in texts]
    second = first[-4:-1]  # one batch of 2 rows at width 256, one of 1 row at 384: the two shapes pooled last
    model = load_verifier_model(str(stories260k), "cpu", "float32")
    new_tokens, batch_size = 8, 4

    def rows_of(engine):
        responder = HFResponder(lambda _device: model, tokenizer, {tokenizer.eos_token_id}, new_tokens, 0.0,
                                batch_size, 512, engine=engine)
        recorder = RowRecorder(responder)
        responder(first)
        calls = [list(recorder.rows)]
        addresses = {key: cache.layers[0].keys.data_ptr() for key, cache in responder.caches.held("cpu").items()}
        responder(second)
        calls.append(recorder.rows[len(calls[0]):])
        return responder, calls, addresses

    _, expected, _ = rows_of("generate")
    static, found, addresses = rows_of(engine)
    assert found == expected
    shapes = [(batch["rows"], batch["width"]) for batch in static.batch_log]
    assert shapes == [(4, 128), (2, 128), (2, 256), (1, 384), (1, 384), (2, 256), (1, 384)]
    for batch in static.batch_log:
        assert batch["cache_width"] == batch["width"] + new_tokens and batch["seconds"] > 0
        assert batch["rows"] <= static_rows(batch["width"], batch_size, new_tokens)
        assert batch["rows"] * batch["cache_width"] <= batch_size * (128 + new_tokens)
    assert static.caches.created == 4  # the second call made none
    held = static.caches.held("cpu")
    assert list(held) == [(2, 256 + new_tokens), (1, 384 + new_tokens)]
    for (rows, width), cache in held.items():  # the engine decoded with these caches, at these shapes
        assert cache.layers[0].keys.shape[0] == rows and cache.layers[0].keys.shape[2] == width
    assert {key: cache.layers[0].keys.data_ptr() for key, cache in held.items()} == addresses


# --- the "loop" engine: sampling and early stopping --------------------------------------------------

def stories_responder(stories260k, engine, stop_ids=None, max_new_tokens=24, temperature=0.0, seed=0):
    """An HFResponder on stories260K (float32, CPU, batches of 4) and the loaded model."""
    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    model = load_verifier_model(str(stories260k), "cpu", "float32")
    stop_ids = {tokenizer.eos_token_id} if stop_ids is None else stop_ids
    responder = HFResponder(lambda _device: model, tokenizer, stop_ids, max_new_tokens, temperature, 4, 512,
                            seed=seed, engine=engine)
    return responder, model


def test_loop_samples_are_reproducible_for_a_seed(stories260k):
    """At temperature 0.7, "loop" replies are the same for one seed and differ for another; they are also
    generate's samples for that seed (softmax(logits / T) and one multinomial draw a step from the same
    seeded generator), and not the greedy replies."""
    conversations = [[{"role": "user", "content": text}] for text in PROMPTS]

    def sampled(engine, seed, temperature=0.7):
        responder, _ = stories_responder(stories260k, engine, temperature=temperature, seed=seed)
        return responder(conversations)

    first = sampled("loop", 0)
    assert sampled("loop", 0) == first
    other = sampled("loop", 1)
    assert sum(a != b for a, b in zip(first, other)) >= len(PROMPTS) // 2
    assert first == sampled("generate", 0)
    assert first != sampled("loop", 0, temperature=0.0)


def test_loop_stops_once_every_row_has_stopped(stories260k):
    """When every row has produced a stop id within its first two tokens, the loop ends its batch at the first
    check (CHECK_EVERY tokens: the prefill's and CHECK_EVERY - 1 decoding forwards), not after all
    `max_new_tokens`; a row that has stopped produces pads; replies equal `generate`'s with the same stop
    ids."""
    from eagle3_pipeline.data.decode_loop import CHECK_EVERY

    conversations = [[{"role": "user", "content": text}] for text in PROMPTS]
    reference, _ = stories_responder(stories260k, "generate", max_new_tokens=2)
    recorder = RowRecorder(reference)
    reference(conversations)
    stop_ids = {row[1] for row in recorder.rows}  # each row's second greedy token (none stopped earlier)
    assert all(len(row) == 2 for row in recorder.rows)

    loop, model = stories_responder(stories260k, "loop", stop_ids, max_new_tokens=3 * CHECK_EVERY)
    raw_rows, decode = [], loop._decode
    loop._decode = lambda row: raw_rows.append(row) or decode(row)
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        replies = loop(conversations)
    finally:
        hook.remove()
    assert len(loop.batch_log) == 2 and loop.hit_max_new_tokens == 0
    assert len(forwards) == CHECK_EVERY * len(loop.batch_log)
    assert [batch["steps"] for batch in loop.batch_log] == [CHECK_EVERY, CHECK_EVERY]
    for row in raw_rows:
        stop = next(i for i, token in enumerate(row) if token in stop_ids)
        assert len(row) == CHECK_EVERY and stop < 2 and set(row[stop + 1:]) == {loop.pad_id}
    expected, _ = stories_responder(stories260k, "generate", stop_ids, max_new_tokens=3 * CHECK_EVERY)
    assert replies == expected(conversations)


def record_compiled_decoding_steps(monkeypatch) -> list:
    """Compile the loop's decoding forward as on a GPU, but with a backend that keeps each graph (in the list
    returned) and runs it eagerly; fullgraph=True, so a graph break raises."""
    from eagle3_pipeline.data import decode_loop

    graphs = []

    def recording_backend(graph, _inputs):
        graphs.append(graph)
        return graph.forward

    options = {"backend": recording_backend, "fullgraph": True, "dynamic": False}
    monkeypatch.setattr(decode_loop, "decoding_forward", lambda model: decode_loop.compiled_forward(model, options))
    return graphs


def test_loop_decoding_step_compiles_to_one_graph_per_batch_shape(stories260k, monkeypatch):
    """The loop's decoding forward, compiled as on a GPU but with a recording backend and fullgraph=True (a
    graph break raises): one graph per batch shape (two here), and the replies of eager `generate`."""
    from eagle3_pipeline.verifier.loading import load_tokenizer

    graphs = record_compiled_decoding_steps(monkeypatch)
    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    conversations = [[{"role": "user", "content": text}] for text in PROMPTS]
    found = replies_by_engine(stories260k, tokenizer, conversations, 12, ("generate", "loop"))
    assert found["loop"][1] == found["generate"][1]
    assert len(graphs) == 2  # batches of 4 and 2 rows


def test_filled_batches_compile_one_step_for_every_call_and_change_no_reply(stories260k, monkeypatch):
    """With full rows (the default on a GPU), each batch of a width is filled to that width's row count: calls
    of 6, 3 and 5 prompts (stage 01's rounds, splits and --synthesize turns end in short batches of any size)
    share one compiled decoding step, where each short batch was a shape of its own before; the filler rows
    change no reply (greedy, equal to `generate`'s), and none is returned."""
    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

    graphs = record_compiled_decoding_steps(monkeypatch)
    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    model = load_verifier_model(str(stories260k), "cpu", "float32")
    reference = HFResponder(lambda _device: model, tokenizer, {tokenizer.eos_token_id}, 12, 0.0, 4, 512,
                            engine="generate")
    filled = HFResponder(lambda _device: model, tokenizer, {tokenizer.eos_token_id}, 12, 0.0, 4, 512, engine="loop")
    filled.full_rows = True
    for count in (6, 3, 5):
        conversations = [[{"role": "user", "content": text}] for text in PROMPTS[:count]]
        assert filled(conversations) == reference(conversations)
    assert len(graphs) == 1  # every batch 4 rows (the width's full count), against 4, 2, 3, 4, 1 unfilled
    assert [batch["rows"] for batch in filled.batch_log] == [4, 2, 3, 4, 1]  # the prompts each batch answered
    assert filled.loop_rows(3, 128, model.device) == 4
    filled.full_rows = None  # the default: filled only where the step is compiled, on a GPU
    assert filled.loop_rows(3, 128, model.device) == 3


def test_dynamic_decode_compile_serves_every_batch_shape_with_one_graph(stories260k, monkeypatch):
    """EAGLE3_DECODE_COMPILE=dynamic: the loop's step compiled with symbolic shapes (as on a GPU, with a recording
    backend) serves batches of 4, 2, 3 and 1 rows and one of a wider cache with at most two graphs (dynamo's first,
    static, then one dynamic), where static compiling makes one per shape (five); the replies stay generate's
    either way. A wrong value is refused."""
    from eagle3_pipeline.data import decode_loop
    from eagle3_pipeline.data.responders import HFResponder
    from eagle3_pipeline.errors import UsageError
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    stop_ids = {tokenizer.eos_token_id}

    def graphs_compiled(way: str) -> int:
        graphs = []

        def recording_backend(graph, _inputs):
            graphs.append(graph)
            return graph.forward

        monkeypatch.setenv("EAGLE3_DECODE_COMPILE", way)
        options = {"static": decode_loop.COMPILE_OPTIONS, "dynamic": decode_loop.DYNAMIC_OPTIONS}[
            decode_loop.compile_way()]
        options = {key: value for key, value in options.items() if key != "mode"}
        options.update(backend=recording_backend, fullgraph=True)
        monkeypatch.setattr(decode_loop, "decoding_forward",
                            lambda model: decode_loop.compiled_forward(model, options))
        model = load_verifier_model(str(stories260k), "cpu", "float32")  # a fresh model: its own compiled step
        loop = HFResponder(lambda _device: model, tokenizer, stop_ids, 12, 0.0, 4, 512, engine="loop")
        reference = HFResponder(lambda _device: model, tokenizer, stop_ids, 12, 0.0, 4, 512, engine="generate")
        long = " ".join(["Lily and Tom went to the park and saw a big dog."] * 14)  # a wider cache: 253 tokens
        for texts in (PROMPTS[:6], PROMPTS[:3], PROMPTS[:1], [long, PROMPTS[0]]):  # 4 and 2, 3, 1, 2 wide rows
            conversations = [[{"role": "user", "content": text}] for text in texts]
            assert loop(conversations) == reference(conversations)
        return len(graphs)

    assert graphs_compiled("static") == 5
    assert 1 <= graphs_compiled("dynamic") <= 2
    monkeypatch.setenv("EAGLE3_DECODE_COMPILE", "fast")
    with pytest.raises(UsageError, match="EAGLE3_DECODE_COMPILE"):
        decode_loop.compile_way()


# --- stage 01: several replies per prompt, resume after a kill ---------------------------------------

STARTS = ["Lily found a", "Tom saw a big", "The cat and the dog", "One sunny day", "A little bird", "Sue had a red",
          "The sky was", "Ben wanted to", "Mom made a cake", "The tree was tall"]


def write_prompts(path, starts):
    import json

    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": s}]} for i, s in enumerate(starts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stage_args(model, template, data, out, *extra):
    return ["--model-path", str(model), "--chat-template", str(template), "--dataset", str(data),
            "--output-dir", str(out), "--regenerate", "--device", "cpu", "--dtype", "float32",
            "--max-seq-len", "256", *extra]


@pytest.fixture()
def template_file(tmp_path):
    path = tmp_path / "stories.jinja"
    path.write_text(STORIES_TEMPLATE)
    return path


def read_jsonl(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_several_sampled_replies_per_prompt_are_samples_with_their_own_ids(tmp_path, stories260k, template_file):
    """--replies-per-prompt 3: every training conversation gives three samples (ID, ID#reply1, ID#reply2) with
    different sampled replies; eval conversations keep one reply and share no prompt with training; a run
    killed after some replies were cached generates only the missing ones."""
    from conftest import run_script
    from eagle3_pipeline.data.records import prompt_hash

    data = write_prompts(tmp_path / "prompts.jsonl", STARTS)
    out = tmp_path / "out"
    args = stage_args(stories260k, template_file, data, out, "--replies-per-prompt", "3", "--temperature", "1.0",
                      "--max-new-tokens", "10", "--eval-ratio", "0.2", "--batch-size", "4")
    done = run_script("01_prepare_data.py", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    train = read_jsonl(out / "tokenized_data.jsonl")
    ids = [s["id"] for s in train]
    assert len(ids) == len(set(ids)) == 8 * 3
    conversations = {i.split("#")[0] for i in ids}
    assert len(conversations) == 8
    assert set(ids) == {f"{c}{suffix}" for c in conversations for suffix in ("", "#reply1", "#reply2")}
    by_conversation = {}
    for sample in train:
        by_conversation.setdefault(sample["id"].split("#")[0], set()).add(tuple(sample["input_ids"]))
    assert all(len(replies) == 3 for replies in by_conversation.values())  # three different sampled replies
    held_out = read_jsonl(out / "eval_data.jsonl")
    assert len(held_out) == 2 and not {s["conversation_id"] for s in held_out} & conversations
    assert all("#reply" not in s["id"] for s in held_out)
    train_hashes = set((out / "train_prompt_hashes.txt").read_text().split())
    assert not {prompt_hash(s["prompt"]) for s in held_out} & train_hashes
    cache = read_jsonl(out / "regenerated.jsonl")
    assert len(cache) == 8 * 3 + 2

    # A kill after part of the replies were written: the cache holds them, the rest is generated.
    kept = [e for e in cache if not e["id"].endswith("#reply2")]
    (out / "regenerated.jsonl").write_text("".join(__import__("json").dumps(e) + "\n" for e in kept)
                                           + '{"id": "c3#reply2", "prom')  # torn last line
    (out / "manifest.json").unlink()
    done = run_script("01_prepare_data.py", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = __import__("json").loads((out / "manifest.json").read_text())
    assert (manifest["regeneration"]["reused"], manifest["regeneration"]["generated"]) == (8 * 2 + 2, 8)
    assert manifest["regeneration"]["replies_per_prompt"] == 3
    assert manifest["regeneration"]["engine"] == "generate"  # the default, auto, on a CPU
    assert sorted(s["id"] for s in read_jsonl(out / "tokenized_data.jsonl")) == sorted(ids)


def test_several_replies_need_sampling_and_regeneration(tmp_path, stories260k, template_file):
    from conftest import run_script

    data = write_prompts(tmp_path / "prompts.jsonl", STARTS[:3])
    greedy = run_script("01_prepare_data.py", *stage_args(stories260k, template_file, data, tmp_path / "a",
                                                          "--replies-per-prompt", "2"))
    assert greedy.returncode == 2 and "greedy replies to one prompt are all the same" in greedy.stdout + greedy.stderr
    args = stage_args(stories260k, template_file, data, tmp_path / "b", "--replies-per-prompt", "2")
    args.remove("--regenerate")
    plain = run_script("01_prepare_data.py", *args)
    assert plain.returncode == 2 and "is set without --regenerate" in plain.stdout + plain.stderr


def test_greedy_first_reply_keeps_the_greedy_reply_beside_sampled_ones(tmp_path, stories260k, template_file):
    """--replies-per-prompt 3 --greedy-first-reply: each training conversation's reply ID (and each eval
    conversation's one reply) is the greedy run's, token for token; ID#reply1 and ID#reply2 are sampled
    (different from it and from each other); the cache records the setting, so a plain sampled run refuses it."""
    from conftest import run_script

    data = write_prompts(tmp_path / "prompts.jsonl", STARTS)
    common = ["--max-new-tokens", "12", "--eval-ratio", "0.2", "--batch-size", "4"]
    greedy_out, mixed_out = tmp_path / "greedy", tmp_path / "mixed"
    done = run_script("01_prepare_data.py", *stage_args(stories260k, template_file, data, greedy_out, *common))
    assert done.returncode == 0, done.stderr[-3000:]
    mixed = stage_args(stories260k, template_file, data, mixed_out, *common, "--replies-per-prompt", "3",
                       "--temperature", "1.0", "--greedy-first-reply")
    done = run_script("01_prepare_data.py", *mixed)
    assert done.returncode == 0, done.stderr[-3000:]

    greedy = {s["id"]: tuple(s["input_ids"]) for s in read_jsonl(greedy_out / "tokenized_data.jsonl")}
    samples = {s["id"]: tuple(s["input_ids"]) for s in read_jsonl(mixed_out / "tokenized_data.jsonl")}
    assert len(greedy) == 8 and len(samples) == 8 * 3
    for conversation, reply in greedy.items():
        replies = {samples[conversation], samples[f"{conversation}#reply1"], samples[f"{conversation}#reply2"]}
        assert samples[conversation] == reply and len(replies) == 3, conversation
    held_out = lambda out: [tuple(s["input_ids"]) for s in read_jsonl(out / "eval_data.jsonl")]  # noqa: E731
    assert held_out(mixed_out) == held_out(greedy_out)
    settings = __import__("json").loads((mixed_out / "regenerated.settings.json").read_text())
    assert settings["greedy_first_reply"] is True and settings["temperature"] == 1.0

    mixed.remove("--greedy-first-reply")
    refused = run_script("01_prepare_data.py", *mixed)
    assert refused.returncode == 2 and "greedy_first_reply" in refused.stdout + refused.stderr


def test_greedy_first_reply_needs_sampled_replies_beside_it(tmp_path, stories260k, template_file):
    from conftest import run_script

    data = write_prompts(tmp_path / "prompts.jsonl", STARTS[:3])
    alone = run_script("01_prepare_data.py", *stage_args(stories260k, template_file, data, tmp_path / "a",
                                                         "--temperature", "0.8", "--greedy-first-reply"))
    assert alone.returncode == 2 and "--greedy-first-reply needs --replies-per-prompt 2" in alone.stdout + alone.stderr


def test_regeneration_resumes_after_a_kill_with_the_same_output(tmp_path, stories260k, template_file):
    """A stage 01 killed (SIGKILL) in the middle of regenerating resumes from its cache, and its output is
    the one an uninterrupted run writes (greedy, the default engine)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO, run_script

    starts = [f"{s} number {i}" for i in range(6) for s in STARTS]  # 60 prompts, batches of 2
    data = write_prompts(tmp_path / "prompts.jsonl", starts)
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    args = ["--max-new-tokens", "24", "--batch-size", "2", "--regenerate-engine", "static"]
    process = subprocess.Popen([sys.executable, str(REPO / "01_prepare_data.py"),
                                *stage_args(stories260k, template_file, data, killed, *args)],
                               cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cache = killed / "regenerated.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if cache.exists() and len(cache.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    cached = len(read_jsonl(cache))
    assert 4 <= cached < 60 and not (killed / "tokenized_data.jsonl").exists()

    done = run_script("01_prepare_data.py", *stage_args(stories260k, template_file, data, killed, *args))
    assert done.returncode == 0, done.stderr[-3000:]
    regeneration = __import__("json").loads((killed / "manifest.json").read_text())["regeneration"]
    assert regeneration["reused"] >= cached and regeneration["reused"] + regeneration["generated"] == 60
    done = run_script("01_prepare_data.py", *stage_args(stories260k, template_file, data, whole, *args))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (killed / "tokenized_data.jsonl").read_text() == (whole / "tokenized_data.jsonl").read_text()


def use_triton_interpreter(monkeypatch):
    """EAGLE3_DECODE_ATTENTION=triton on this CPU: the kernel runs in Triton's interpreter (conftest.py sets
    TRITON_INTERPRET; the GPU's compiled kernel is checked by scripts/lab/bench_decode_attention.py); skips where
    Triton is not installed."""
    pytest.importorskip("triton", reason="Triton is not installed (requirements-test.txt installs it)")
    monkeypatch.setenv("EAGLE3_DECODE_ATTENTION", "triton")


@pytest.mark.parametrize("way", ["sdpa", "matmul", "triton"])
def test_grouped_decode_attention_equals_transformers_sdpa(way, monkeypatch):
    """One decoding step with a left-padding mask: the folded heads as two matmuls (the default), as one
    grouped-query SDPA call (EAGLE3_DECODE_ATTENTION=sdpa) and as the Triton kernel give transformers' `sdpa`
    result (which copies each K/V head per query head), including a value head size unlike the query's (which
    the kernel leaves to the matmuls), and at Llama-3.1-8B's heads (32 query heads on 8 K/V heads of 128)."""
    import torch

    if way == "triton":
        use_triton_interpreter(monkeypatch)
    monkeypatch.setenv("EAGLE3_DECODE_ATTENTION", way)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eagle3_pipeline.verifier.decode_attention import gqa_decode_attention

    torch.manual_seed(0)

    class Layer(torch.nn.Module):
        is_causal = True

    for heads, kv_heads, dim, value_dim in ((6, 2, 16, 16), (6, 2, 16, 24), (32, 8, 128, 128)):
        layer = Layer()
        layer.num_key_value_groups = heads // kv_heads
        query = torch.randn(4, heads, 1, dim)
        key, value = torch.randn(4, kv_heads, 10, dim), torch.randn(4, kv_heads, 10, value_dim)
        mask = torch.ones(4, 1, 1, 10, dtype=torch.bool)
        mask[1, ..., :3] = False  # a left-padded row
        mask[3, ..., :7] = False
        expected, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=dim ** -0.5)
        found, _ = gqa_decode_attention(layer, query, key, value, mask, scaling=dim ** -0.5)
        assert found.shape == expected.shape == (4, 1, heads, value_dim)
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_an_unknown_decode_attention_way_is_refused_by_name(monkeypatch):
    import torch

    from eagle3_pipeline.verifier.decode_attention import gqa_decode_attention

    class Layer(torch.nn.Module):
        num_key_value_groups = 2

    monkeypatch.setenv("EAGLE3_DECODE_ATTENTION", "flash")
    query, key = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="EAGLE3_DECODE_ATTENTION='flash'.*matmul, sdpa, triton"):
        gqa_decode_attention(Layer(), query, key, key, None)


def test_the_decoding_attention_is_the_triton_kernel_on_a_gpu_and_the_matmuls_on_a_cpu(monkeypatch):
    """With EAGLE3_DECODE_ATTENTION unset: Triton's kernel on a GPU where Triton is installed, the matmuls on a
    CPU (and on a GPU without Triton); the variable overrides both."""
    import importlib.util

    from eagle3_pipeline.verifier.decode_attention import chosen_way

    monkeypatch.delenv("EAGLE3_DECODE_ATTENTION", raising=False)
    assert chosen_way(on_gpu=False) == "matmul"
    assert chosen_way(on_gpu=True) == ("triton" if importlib.util.find_spec("triton") else "matmul")
    monkeypatch.setenv("EAGLE3_DECODE_ATTENTION", "sdpa")
    assert chosen_way(on_gpu=True) == chosen_way(on_gpu=False) == "sdpa"


def test_a_triton_kernel_that_cannot_run_stops_the_run_or_leaves_it_to_the_matmuls(smollm2, monkeypatch, caplog):
    """Before the first batch the kernel is built and checked at the model's heads: where it works (here, in
    Triton's interpreter) nothing is said; where it fails (a stand-in launch raising, as Triton does on a GPU it
    cannot build for), EAGLE3_DECODE_ATTENTION=triton stops the run naming the fix, and the GPU default falls
    back to the matmuls with a warning."""
    import logging

    use_triton_interpreter(monkeypatch)
    from eagle3_pipeline.verifier import decode_attention, triton_decode
    from eagle3_pipeline.verifier.loading import load_verifier_model

    model = load_verifier_model(str(smollm2), "cpu", "float32")
    triton_decode.problem_with.cache_clear()
    decode_attention.check_triton(model)  # builds and agrees: no error, no warning
    assert triton_decode.problem_with.cache_info().currsize == 1 and not caplog.records

    def out_of_resources(*_args, **_kwargs):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(triton_decode, "launch", out_of_resources)
    triton_decode.problem_with.cache_clear()
    with pytest.raises(ValueError, match="out of resource.*EAGLE3_DECODE_ATTENTION=matmul"):
        decode_attention.check_triton(model)
    monkeypatch.delenv("EAGLE3_DECODE_ATTENTION")
    monkeypatch.setattr(decode_attention, "GPU_DEFAULT", "triton")
    with caplog.at_level(logging.WARNING):
        decode_attention.check_triton(model)
    assert decode_attention.GPU_DEFAULT == "matmul" and "the matmuls decode instead" in caplog.text
    triton_decode.problem_with.cache_clear()


def test_triton_decode_blocks_fit_the_shared_memory_of_small_gpus():
    """The K/V tiles of every pipeline stage stay within TILE_BYTES (SM120 GPUs have about 100 KB a block): the
    swept block of 128 at SmolLM2's bf16 heads of 64, smaller ones for wider heads and float32."""
    from eagle3_pipeline.verifier.triton_decode import TILE_BYTES, block_for

    assert block_for(64, 2, 128, 2) == 128
    assert block_for(128, 2, 128, 2) == 64 and block_for(64, 4, 128, 2) == 64
    assert block_for(256, 4, 128, 3) == 16
    for dim, size, stages in ((64, 2, 2), (128, 2, 2), (128, 4, 3), (256, 2, 2)):
        assert 2 * stages * block_for(dim, size, 128, stages) * dim * size <= TILE_BYTES


def test_triton_decode_attention_skips_hidden_blocks_and_keeps_bfloat16_rounding(monkeypatch):
    """The kernel over a cache whose mask hides whole blocks (left padding, the unwritten tail) and blocks in
    part, with hidden blocks skipped by a branch and without: float32 as the matmuls to 1e-5; bfloat16 within
    one rounding of the matmuls' bfloat16 result; K/V in hidden positions (NaN here) never reach the output."""
    import torch

    use_triton_interpreter(monkeypatch)
    from eagle3_pipeline.verifier.decode_attention import matmul_attention
    from eagle3_pipeline.verifier.triton_decode import OPTIONS, launch, triton_decode_attention

    torch.manual_seed(0)
    block = OPTIONS["block"]
    width = 3 * block + 10
    mask = torch.zeros(3, 1, 1, width, dtype=torch.bool)
    mask[0, ..., 5:2 * block + 2] = True
    mask[1, ..., block + 6:2 * block + 2] = True  # the first block entirely padding
    mask[2, ..., :1] = True
    hidden = ~mask[:, 0, 0][:, None].expand(3, 3, width)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        query = torch.randn(3, 9, 1, 64, dtype=dtype)
        key, value = torch.randn(3, 3, width, 64, dtype=dtype), torch.randn(3, 3, width, 64, dtype=dtype)
        expected = matmul_attention(query.view(3, 3, 3, 64), key, value, mask).reshape(3, 9, 1, 64).float()
        key[hidden], value[hidden] = float("nan"), float("nan")
        for found in (triton_decode_attention(query, key, value, mask),
                      launch(query, key, value, mask, 64 ** -0.5, **{**OPTIONS, "skip": not OPTIONS["skip"]})):
            assert found.dtype == torch.float32 and not found.isnan().any()
            torch.testing.assert_close(found, expected, rtol=tolerance, atol=tolerance)


def test_triton_decode_attention_keeps_the_loop_token_for_token(smollm2, monkeypatch):
    """EAGLE3_DECODE_ATTENTION=triton (in Triton's interpreter here): the loop's float32 greedy replies on
    SmolLM2 are still generate's, token for token, and its compiled decoding step is one graph per batch
    shape with the kernel inside (fullgraph=True: a graph break raises)."""
    from eagle3_pipeline.verifier.loading import load_tokenizer

    use_triton_interpreter(monkeypatch)
    graphs = record_compiled_decoding_steps(monkeypatch)
    tokenizer = load_tokenizer(str(smollm2))
    conversations = [[{"role": "user", "content": text}] for text in
                     ["Write a haiku about rain.", "List three colours and explain why the sky looks blue."]]
    found = replies_by_engine(smollm2, tokenizer, conversations, 12, ("generate", "loop"))
    assert all(found["generate"][0]) and found["loop"][1] == found["generate"][1]
    assert len(graphs) == 1
    assert any("triton_decode_attention" in str(node.target) for node in graphs[0].graph.nodes)


def test_auto_engine_is_static_on_a_gpu_and_generate_on_a_cpu():
    """A static cache is compiled on a GPU (3x generate on an H200) but measured 1.7x slower than generate on a
    CPU, so the default picks by device; an engine named explicitly is kept."""
    from eagle3_pipeline.data.responders import resolve_engine

    assert resolve_engine("auto", ["cpu"]) == "generate"
    assert resolve_engine("auto", ["cuda:0", "cuda:1"]) == "static"
    assert resolve_engine("static", ["cpu"]) == "static"
    assert resolve_engine("continuous", ["cuda:0"]) == "continuous"


def test_fill_counters_are_the_static_cache_layers_device_counters(stories260k):
    """cuda_graphs.fill_counters: one counter per layer of a transformers StaticCache, advanced in place by a
    forward (the capture puts them back after its warm-up step); a cache without them is refused, naming the
    fallback. (The capture itself needs CUDA: scripts/lab/bench_regenerate.py measures it on a GPU.)"""
    import torch
    from transformers import DynamicCache, StaticCache

    from eagle3_pipeline.data.cuda_graphs import fill_counters
    from eagle3_pipeline.data.static_cache import forward_cache_keyword
    from eagle3_pipeline.verifier.loading import load_verifier_model

    model = load_verifier_model(str(stories260k), "cpu", "float32")
    cache = StaticCache(config=model.config, max_cache_len=32)
    given = {forward_cache_keyword(type(model)): cache, "use_cache": True}
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), **given)
    counters = fill_counters(cache)
    assert len(counters) == model.config.num_hidden_layers and [int(c) for c in counters] == [5] * len(counters)
    before = [c.data_ptr() for c in counters]
    with torch.inference_mode():
        model(input_ids=torch.tensor([[6]]), position_ids=torch.tensor([[5]]), **given)
    assert [int(c) for c in fill_counters(cache)] == [6] * len(counters)
    assert [c.data_ptr() for c in fill_counters(cache)] == before  # in place: a captured graph keeps its address
    with pytest.raises(RuntimeError, match="EAGLE3_DECODE_COMPILE=static"):
        fill_counters(DynamicCache())
