"""Stage 01's regeneration engines (common.data.responders.HFResponder, --regenerate-engine): static-cache
`generate` and transformers' continuous batching give, greedily in float32, the same replies token for token
as plain `generate` (the first engine), on stories260K and SmolLM2; several sampled replies per prompt."""
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
    from common.data.responders import HFResponder
    from common.verifier.loading import load_verifier_model

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


def test_engines_agree_token_for_token_on_stories260k(stories260k):
    from common.verifier.loading import load_tokenizer

    tokenizer = load_tokenizer(str(stories260k))
    tokenizer.chat_template = STORIES_TEMPLATE
    conversations = [[{"role": "user", "content": text}] for text in PROMPTS]
    found = replies_by_engine(stories260k, tokenizer, conversations, 24, ("generate", "static", "continuous"))
    reference = found["generate"]
    assert len(set(reference[0])) >= 4 and all(reference[0])
    for engine in ("static", "continuous"):
        assert found[engine][1] == reference[1], engine
        assert found[engine][0] == reference[0] and found[engine][2] == reference[2], engine


def test_engines_agree_token_for_token_on_smollm2(smollm2):
    from common.verifier.loading import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2))
    conversations = [[{"role": "user", "content": text}] for text in
                     ["What is the capital of France?", "Write a haiku about rain.", "Say hi.",
                      "List three colours and explain why the sky looks blue during the day."]]
    found = replies_by_engine(smollm2, tokenizer, conversations, 16, ("generate", "static", "continuous"))
    reference = found["generate"]
    assert all(reference[0]) and len(set(reference[0])) == 4
    for engine in ("static", "continuous"):
        assert found[engine][1] == reference[1], engine
