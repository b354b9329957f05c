"""Where a user turn opens and closes in a chat template, found by rendering it (stage 01 --synthesize).

Nothing is written per model: a conversation is rendered with a sentinel as the user's text, and the text
around the sentinel is the template's own opening and closing of a user turn. The prompt the verifier
continues to write a user turn is the conversation so far rendered with the sentinel as the next user turn,
cut just before the sentinel (BOS, a default system prompt and the opening all come from the template).
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.data.records import ASSISTANT, USER

# Plain ASCII letters and digits: no template escapes, trims or case-folds them away.
SENTINEL = "Zq7SentinelUserTurn9Xk"
_FILLER_USER, _FILLER_REPLY = "Hello there.", "Hi, how can I help?"


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def _common_prefix_length(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _sentinel_split(text: str, what: str) -> tuple[str, str]:
    if text.count(SENTINEL) != 1:
        raise UsageError(f"the chat template does not render a {what} with its user text once; --synthesize needs "
                         "a template that writes each message's content as given (--chat-template FILE)")
    before, _, after = text.partition(SENTINEL)
    return before, after


def user_turn_prefix(tokenizer, history: list[dict]) -> str:
    """The text the verifier continues to write the next user turn: `history` rendered, then the next user
    turn opened (for an empty history: the template's BOS and default system prompt, if any, then the opening)."""
    before, _ = _sentinel_split(_render(tokenizer, history + [{"role": USER, "content": SENTINEL}]),
                                "conversation")
    return before


def user_turn_opening(tokenizer) -> str:
    """The template's own text before a user's words (e.g. ChatML's "<|im_start|>user\\n"): a conversation with
    and without one more user turn, minus what the two share."""
    earlier = [{"role": USER, "content": _FILLER_USER}, {"role": ASSISTANT, "content": _FILLER_REPLY}]
    shorter = _render(tokenizer, earlier)
    before, _ = _sentinel_split(_render(tokenizer, earlier + [{"role": USER, "content": SENTINEL}]), "second turn")
    return before[_common_prefix_length(shorter, before):]


def user_turn_closing(tokenizer) -> str:
    """The template's text after a user's words at the end of a conversation (ChatML: "<|im_end|>\\n")."""
    _, after = _sentinel_split(_render(tokenizer, [{"role": USER, "content": SENTINEL}]), "conversation")
    return after


def template_special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special and added tokens that the template itself writes (in a rendered two-turn
    conversation): inside a user's words they are a leak of the template."""
    earlier = [{"role": USER, "content": _FILLER_USER}, {"role": ASSISTANT, "content": _FILLER_REPLY}]
    rendered = _render(tokenizer, earlier + [{"role": USER, "content": SENTINEL}])
    rendered += tokenizer.apply_chat_template(earlier, tokenize=False, add_generation_prompt=True)
    candidates = set(getattr(tokenizer, "all_special_tokens", []) or []) | set(tokenizer.get_added_vocab())
    return sorted(token for token in candidates if token and token in rendered)


@dataclass(frozen=True)
class UserTurnFormat:
    """What parsing a sampled user turn needs: the ids that end it, the text that closes it, the template's tokens."""
    stop_ids: frozenset[int]
    closing: str          # cut the turn where this text begins (whitespace-only closings as they are)
    special_tokens: tuple[str, ...]

    @classmethod
    def of(cls, tokenizer, stop_ids: set[int]) -> "UserTurnFormat":
        closing = user_turn_closing(tokenizer)
        marker = closing.strip() or closing
        ids = set(stop_ids)
        first = tokenizer(marker, add_special_tokens=False)["input_ids"][:1] if marker else []
        if first and tokenizer.convert_ids_to_tokens(first[0]) in template_special_tokens(tokenizer):
            ids.add(int(first[0]))  # a special token closes the turn: stop there, as at an end of turn
        return cls(frozenset(ids), marker, tuple(template_special_tokens(tokenizer)))

    def parse(self, tokenizer, row: list[int] | None) -> tuple[str, bool]:
        """The user's words in a sampled row of token ids (special tokens kept, so leaks show), and whether the
        turn ended (a stop id or the closing text) rather than running out of tokens."""
        if row is None:  # no room left for the turn in --max-seq-len
            return "", False
        stop = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
        text = tokenizer.decode(row if stop is None else row[:stop], skip_special_tokens=False)
        ended = stop is not None
        if self.closing and self.closing in text:
            text, ended = text[:text.index(self.closing)], True
        return text.strip(), ended

    def leaked(self, text: str) -> str | None:
        """The first template token found inside a user's words, or None."""
        return next((token for token in self.special_tokens if token in text), None)
