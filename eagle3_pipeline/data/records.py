"""Chat records: normalised conversations and texts, bad records, ids, duplicates and prompt hashes."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLE_ALIASES = {
    "human": USER, "user": USER,
    "gpt": ASSISTANT, "assistant": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT, "bard": ASSISTANT,
    "system": SYSTEM,
}
_EXAMPLES_PER_REASON = 5


# --- prompts -------------------------------------------------------------------------------------

def normalise_prompt(text: str) -> str:
    return " ".join(text.split()).lower()


def prompt_hash(text: str) -> str:
    """sha256 of a prompt with whitespace collapsed and case folded: how stages compare prompts."""
    return hashlib.sha256(normalise_prompt(text).encode("utf-8")).hexdigest()


PREFIX_WORDS = 32  # a benchmark prompt that starts with the same 32 words as a training text overlaps it


def _prefix(text: str) -> str | None:
    words = text.split()
    return " ".join(words[:PREFIX_WORDS]) if len(words) >= PREFIX_WORDS else None


def text_prompt_hashes(text: str) -> set[str]:
    """What of a plain-text (or completion) training record a benchmark prompt could repeat: the whole text, its
    first line (the prompt of a prompt-newline-completion text) and its first PREFIX_WORDS words."""
    parts = [text, text.strip().split("\n", 1)[0], _prefix(text)]
    return {prompt_hash(part) for part in parts if part and part.strip()}


def benchmark_prompt_hashes(turn: str) -> set[str]:
    """The hashes of a benchmark turn that are looked up among the training hashes (see text_prompt_hashes)."""
    return {prompt_hash(part) for part in (turn, _prefix(turn)) if part}


def first_user_prompt(messages: list[dict]) -> str | None:
    return next((m["content"] for m in messages if m["role"] == USER), None)


def training_prompt_hashes(record: "Record") -> set[str]:
    """The hashes train_prompt_hashes.txt keeps of a training record, which stage 05's overlap check looks
    benchmark turns up in (benchmark_prompt_hashes): a conversation's first user prompt, a text's parts."""
    if record.is_chat:
        prompt = first_user_prompt(record.messages)
        return {prompt_hash(prompt)} if prompt else set()
    return text_prompt_hashes(record.text)


def drop_prompts(records: list["Record"], excluded: set[str]) -> tuple[list["Record"], int]:
    """The records none of whose training prompts is in `excluded` (benchmark_prompt_hashes of prompts that
    must not be trained on), and how many were dropped."""
    if not excluded:  # the usual run: no prompt hashed
        return records, 0
    kept = [r for r in records if training_prompt_hashes(r).isdisjoint(excluded)]
    return kept, len(records) - len(kept)


# --- records and bad records -----------------------------------------------------------------------

@dataclass
class Record:
    """One usable input record: a chat conversation (normalised messages) or a plain text."""
    id: str
    source: str          # the --dataset value it came from
    line: int            # line (JSONL), starting line (JSON array) or row (parquet, hub) number
    messages: list[dict] | None = None
    text: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def content_key(self) -> bytes:
        """Identity of the content, for exact-duplicate removal."""
        payload = ["chat", [[m["role"], m["content"]] for m in self.messages]] if self.is_chat \
            else ["text", self.text]
        return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode("utf-8")).digest()


class BadRecordError(Exception):
    """A record that cannot be used, with a short machine-readable reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class BadRecords:
    """Unusable records counted by reason, keeping every location (for the sidecar file)."""
    counts: Counter = field(default_factory=Counter)
    entries: list[dict] = field(default_factory=list)

    def add(self, reason: str, source: str, line: int | None, detail: str = "", record_id: Any = None) -> None:
        """record_id: the record's own id, which tells apart records that share a line (a one-line JSON array);
        an id made up from the location itself (records without one) adds nothing and is left out."""
        self.counts[reason] += 1
        entry = {"reason": reason, "source": source, "line": line, "detail": detail[:300]}
        own = own_id(record_id)
        if own is not None and own.partition(REPEAT_MARK)[0] != location_id(source, line):
            entry["id"] = own
        self.entries.append(entry)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def examples(self, reason: str, limit: int = _EXAMPLES_PER_REASON) -> list[str]:
        found = [e for e in self.entries if e["reason"] == reason][:limit]
        return [f"{e['source']}:{e['line']}" + (f" id {e['id']}" if "id" in e else "")
                + (f" ({e['detail']})" if e["detail"] else "") for e in found]

    def log(self, log, stage_part: str) -> None:
        for reason, count in self.counts.most_common():
            log.warning("%s: %d bad record(s) [%s], e.g. %s", stage_part, count, reason,
                        "; ".join(self.examples(reason)))

    def summary(self) -> dict[str, Any]:
        return {"counts": dict(self.counts.most_common()),
                "examples": {reason: self.examples(reason, 10) for reason in self.counts}}


# --- roles and normalisation --------------------------------------------------------------------------

def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of OpenAI-style content lists."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type", "text") != "text" for p in content):
            raise BadRecordError("non_text_content", "content has non-text parts")
        return "".join(str(p.get("text", "")) for p in content)
    if content is None:
        return ""
    raise BadRecordError("bad_turn", f"content is a {type(content).__name__}, not text")


def role_of(turn: dict) -> str | None:
    """The turn's role (system, user, assistant, ...) from ShareGPT's `from` or OpenAI's `role`; None if unknown."""
    raw_role = turn.get("from", turn.get("role"))
    return None if raw_role is None else ROLE_ALIASES.get(str(raw_role).strip().lower())


def normalise_turn(turn: Any, index: int) -> dict:
    if not isinstance(turn, dict):
        raise BadRecordError("bad_turn", f"turn {index} is a {type(turn).__name__}, not an object")
    raw_role = turn.get("from", turn.get("role"))
    if raw_role is None or not ({"value", "content"} & turn.keys()):
        raise BadRecordError("missing_fields", f"turn {index} needs from/value or role/content")
    role = role_of(turn)
    if role is None:
        raise BadRecordError("unknown_role", f"turn {index} has role {raw_role!r}")
    # Stripped, so a template's separator and the content never merge into one token at the boundary.
    text = _content_text(turn["value"] if "value" in turn else turn["content"]).strip()
    if not text:
        raise BadRecordError("empty_turn", f"turn {index} ({raw_role}) is empty")
    return {"role": role, "content": text}


def normalise_messages(turns: Any) -> list[dict]:
    """Roles mapped to user/assistant/system; assistant turns before the first user turn dropped.

    ShareGPT splits long conversations into parts whose later parts start with a `gpt` turn; the
    reply to an unseen prompt is not trainable, so those leading replies are dropped (system kept).
    """
    if not isinstance(turns, list):
        raise BadRecordError("bad_turn", f"the turn list is a {type(turns).__name__}")
    if not turns:
        raise BadRecordError("no_turns")
    messages = [normalise_turn(turn, i) for i, turn in enumerate(turns)]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == USER), None)
    if first_user is None:
        raise BadRecordError("no_user_turn")
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] == SYSTEM]


# --- ids ----------------------------------------------------------------------------------------------

def own_id(raw: Any) -> str | None:
    """A record's id as its data gives it, if usable (a non-blank string or an integer)."""
    return str(raw) if isinstance(raw, (str, int)) and str(raw).strip() else None


def location_id(source: str, line: int | None) -> str:
    """The id of a record that has none of its own: where it is."""
    return f"{Path(source).name}:{line}"


# --- records ------------------------------------------------------------------------------------------

def normalise_record(obj: Any, source: str, line: int) -> Record:
    if not isinstance(obj, dict):
        raise BadRecordError("not_an_object", f"a {type(obj).__name__}")
    record_id = own_id(obj.get("id")) or location_id(source, line)
    for key in ("conversations", "messages", "conversation"):
        if obj.get(key) is not None:
            return Record(record_id, source, line, messages=normalise_messages(obj[key]))
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text.strip():
            raise BadRecordError("empty_text")
        return Record(record_id, source, line, text=text)
    raise BadRecordError("missing_fields", "expected a conversations, messages or text field")


# --- duplicates and unique ids ------------------------------------------------------------------------

def remove_duplicates(records: list[Record]) -> tuple[list[Record], int]:
    """Exact duplicates (same roles and contents, or same text) removed, keeping the first."""
    seen: set[bytes] = set()
    unique = []
    for record in records:
        key = record.content_key()
        if key not in seen:
            seen.add(key)
            unique.append(record)
    return unique, len(records) - len(unique)


REPEAT_MARK = "~"  # a repeated id gets REPEAT_MARK + N


def make_ids_unique(records: list[Record]) -> None:
    """Records keep their dataset ids; a repeated id gets a ~N suffix so ids stay unique."""
    used: Counter = Counter()
    for i, record in enumerate(records):
        used[record.id] += 1
        if used[record.id] > 1:
            new_id = f"{record.id}{REPEAT_MARK}{used[record.id]}"
            while new_id in used:
                used[record.id] += 1
                new_id = f"{record.id}{REPEAT_MARK}{used[record.id]}"
            used[new_id] += 1
            records[i] = replace(record, id=new_id)


def keep_first_user_turns(messages: list[dict], max_user_turns: int) -> list[dict]:
    """The conversation up to (not including) its (max_user_turns + 1)-th user turn."""
    kept, users = [], 0
    for message in messages:
        if message["role"] == "user":
            users += 1
            if users > max_user_turns:
                break
        kept.append(message)
    return kept
