"""Tokenizing records with the verifier's chat template: exact assistant loss masks, samples, token statistics.

How the masks are computed (re-encoded rendered prefixes, trimmed after the end-of-turn token) is in docs/data.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from eagle3_pipeline.data.records import ASSISTANT, BadRecordError, Record

# Special tokens that end an assistant turn in the common chat formats (only those in the vocabulary count).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                      "<|end_of_text|>", "[EOS]", "<｜end▁of▁sentence｜>")
LOSS_MASK_CONVENTION = ("1 on assistant content tokens and the end-of-turn token that closes each assistant "
                        "turn; 0 on system/user turns, role headers, the generation prompt and template text "
                        "after the end-of-turn token (ChatML's newline). Plain-text records: 1 everywhere.")
# A token covers at most as many characters as its vocabulary string has (byte-level BPE, SentencePiece pieces,
# byte fallback); twice that allows for normalisers that fold two characters into one (NFKC).
CHARS_PER_TOKEN_MARGIN = 2


# --- tokenization and loss masks ---------------------------------------------------------------------

@dataclass
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


def end_of_turn_ids(tokenizer, model_folder: str | None = None) -> set[int]:
    """Token ids that end an assistant turn: eos, the generation config's eos ids, known turn ends."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_folder is not None:
        gen_config = Path(model_folder) / "generation_config.json"
        if gen_config.is_file():
            try:
                eos = json.loads(gen_config.read_text()).get("eos_token_id")
            except json.JSONDecodeError:
                eos = None
            ids.update([eos] if isinstance(eos, int) else [int(e) for e in eos or []])
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        # Unknown tokens map to the unk id (or None); only tokens that map back to themselves count.
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
            ids.add(token_id)
    return ids


def _is_prefix(prefix: list[int], full: list[int]) -> bool:
    return len(prefix) <= len(full) and full[:len(prefix)] == prefix


class ChatTokenizer:
    """Renders conversations with the verifier's chat template and builds exact loss masks."""

    def __init__(self, tokenizer, stop_ids: set[int], max_seq_len: int):
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.max_seq_len = max_seq_len
        self.split_turn_samples = 0    # turns that became their own sample (template not prefix-stable)
        self.dropped_turns = 0         # turns with no token boundary after the generation prompt

    @cached_property
    def char_bound(self) -> int:
        """Characters that surely hold more than max_seq_len tokens: text past them is never kept, so it is cut
        before tokenizing (a 50 MB record would otherwise take gigabytes to tokenize whole)."""
        longest = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
        return CHARS_PER_TOKEN_MARGIN * max(1, longest) * (self.max_seq_len + 1)

    def cut(self, text: str) -> str:
        """The text up to char_bound: its first max_seq_len tokens are those of the whole text."""
        if len(text) <= 2 * self.max_seq_len:  # below any bound: no need to look at the vocabulary
            return text
        return text[:self.char_bound]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as err:  # noqa: BLE001 - jinja raises its own errors for unsupported layouts
            raise BadRecordError("template_error", f"{type(err).__name__}: {str(err)[:200]}")

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        # Chat templates write their own special tokens, so none are added here (as apply_chat_template does).
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _turn_end(self, ids: list[int], start: int, end: int) -> int:
        """End of the turn's loss span: just after its last end-of-turn token (template filler excluded)."""
        for position in range(end - 1, start - 1, -1):
            if ids[position] in self.stop_ids:
                return position + 1
        return end

    def _mask(self, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
        mask = [0] * len(ids)
        for start, end in spans:
            for position in range(start, self._turn_end(ids, start, end)):
                mask[position] = 1
        return mask

    def conversation(self, record_id: str, messages: list[dict]) -> list[Sample]:
        """Samples of one conversation (usually one); raises BadRecordError when none can be made."""
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == ASSISTANT), default=None)
        if last_assistant is None:
            raise BadRecordError("no_assistant_turn")
        messages = messages[:last_assistant + 1]  # trailing user turns have nothing to learn
        messages = [{**m, "content": self.cut(m["content"])} for m in messages]
        turns: list[tuple[int, list[int], list[int]]] = []  # (index, ids before turn, ids through turn)
        for k, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            before, through = self.encode_many([self.render(messages[:k], True), self.render(messages[:k + 1], False)])
            turns.append((k, before, through))
            if len(through) >= self.max_seq_len:
                break  # later turns start past the truncation point
        full = turns[-1][2]
        stable, unstable = [], []
        for k, before, through in turns:
            ok = _is_prefix(before, full) and _is_prefix(through, full)
            (stable if ok else unstable).append((k, before, through))
        samples = []
        if stable:
            spans = [(len(before), len(through)) for _, before, through in stable]
            samples.append(self._truncated(Sample(record_id, full, self._mask(full, spans))))
        for k, before, through in unstable:
            if not _is_prefix(before, through):
                self.dropped_turns += 1
                continue
            self.split_turn_samples += 1
            sample = Sample(f"{record_id}#turn{k}", through, self._mask(through, [(len(before), len(through))]))
            samples.append(self._truncated(sample))
        if not samples:
            raise BadRecordError("template_not_prefix_stable",
                                 "no assistant turn starts on a token boundary after the generation prompt")
        return samples

    def text(self, record_id: str, text: str) -> list[Sample]:
        """Plain text: loss on every token."""
        ids = list(self.tokenizer(self.cut(text))["input_ids"])
        return [self._truncated(Sample(record_id, ids, [1] * len(ids)))]

    def _truncated(self, sample: Sample) -> Sample:
        if len(sample.input_ids) <= self.max_seq_len:
            return sample
        return Sample(sample.id, sample.input_ids[:self.max_seq_len], sample.loss_mask[:self.max_seq_len], True)

    def record(self, record: Record) -> list[Sample]:
        """All samples of a record that have something to learn; raises BadRecordError if none."""
        samples = self.conversation(record.id, record.messages) if record.is_chat else self.text(record.id, record.text)
        kept = [s for s in samples if s.loss_tokens > 0]
        if not kept:
            reason = "no_loss_tokens_after_truncation" if any(s.truncated for s in samples) else "no_loss_tokens"
            raise BadRecordError(reason, f"longer than --max-seq-len {self.max_seq_len} before any assistant token"
                                 if reason.endswith("truncation") else "")
        return kept


# --- statistics ------------------------------------------------------------------------------------

def percentile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


@dataclass
class TokenStats:
    lengths: list[int] = field(default_factory=list)
    loss_tokens: int = 0
    truncated: int = 0

    def add(self, sample: Sample) -> None:
        self.lengths.append(len(sample.input_ids))
        self.loss_tokens += sample.loss_tokens
        self.truncated += int(sample.truncated)

    def summary(self) -> dict[str, Any]:
        values = sorted(self.lengths)
        tokens = sum(values)
        return {
            "samples": len(values), "tokens": tokens, "loss_tokens": self.loss_tokens,
            "loss_fraction": round(self.loss_tokens / tokens, 4) if tokens else 0.0,
            "truncated": self.truncated,
            "length": {"min": values[0] if values else 0, "mean": round(tokens / len(values), 1) if values else 0,
                       "p50": percentile(values, 50), "p90": percentile(values, 90),
                       "p99": percentile(values, 99), "max": values[-1] if values else 0},
        }


def sample_line(sample: Sample, extra: dict | None = None) -> str:
    obj = {"id": sample.id, **(extra or {}), "input_ids": sample.input_ids, "loss_mask": sample.loss_mask}
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
