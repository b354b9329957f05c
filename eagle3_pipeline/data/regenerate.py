"""Regenerating assistant turns with the verifier itself (stage 01 --regenerate): the resumable cache and the
turn-by-turn driver over a responder (eagle3_pipeline.data.responders); docs/data.md explains the design.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.data.records import ASSISTANT, USER
from eagle3_pipeline.data.regen_progress import RegenerationProgress

CACHE_FILE = "regenerated.jsonl"
SETTINGS_FILE = "regenerated.settings.json"
# Bad reason of a conversation the endpoint failed to answer: transient, so it is not reused from the
# cache but asked again on the next run.
ENDPOINT_FAILED = "endpoint_failed"

Responder = Callable[[list[list[dict]]], list["str | None"]]


# --- conversations as prompt segments --------------------------------------------------------------

def prompt_segments(messages: list[dict]) -> list[list[dict]]:
    """The runs of non-assistant messages; one reply is generated after each run.

    [system, user1, assistant1, user2, assistant2] -> [[system, user1], [user2]]; a trailing user turn
    also gets a reply; runs of several data assistant turns are replaced by one generated reply.
    """
    segments: list[list[dict]] = []
    current: list[dict] = []
    for message in messages:
        if message["role"] == ASSISTANT:
            if current:
                segments.append(current)
                current = []
        else:
            current.append({"role": message["role"], "content": message["content"]})
    if current:
        segments.append(current)
    return segments


def answers_several_prompts_at_once(messages: list[dict]) -> bool:
    """Whether two user turns follow each other: a regenerated reply then answers both at once, after the
    second (a prompts-only file that dropped the reply between them reads this way)."""
    return any(sum(m["role"] == USER for m in segment) > 1 for segment in prompt_segments(messages))


def prompts_hash(messages: list[dict]) -> str:
    """Identity of what generation depends on in a conversation: its non-assistant turns."""
    payload = json.dumps(prompt_segments(messages), ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


# --- the resumable cache ---------------------------------------------------------------------------

class RegenerationCache:
    """regenerated.jsonl: one line per finished conversation, {"id", "prompts_sha256", "messages"} or
    {"id", "prompts_sha256", "bad": reason, "detail"}; the last line for an id wins."""

    def __init__(self, folder: str | os.PathLike, settings: dict[str, Any], name: str = CACHE_FILE):
        self.path = Path(folder) / name  # another name: the same kind of file (stage 01 --synthesize's rounds)
        settings_name = SETTINGS_FILE if name == CACHE_FILE else f"{Path(name).stem}.settings.json"
        self.settings_path = Path(folder) / settings_name
        self.settings = settings

    def differences(self) -> list[str]:
        """How the existing cache's generation settings differ from ours ([] when none or no cache)."""
        if not self.path.exists() or not self.settings_path.exists():
            return []
        try:
            previous = json.loads(self.settings_path.read_text())
        except json.JSONDecodeError:
            previous = {}
        keys = sorted(set(previous) | set(self.settings))
        return [f"{k}: {previous.get(k)!r} -> {self.settings.get(k)!r}" for k in keys
                if previous.get(k) != self.settings.get(k)]

    def check_settings(self) -> None:
        """Refuse to extend a cache made with other generation settings (its replies would be mixed)."""
        differing = self.differences()
        if differing:
            raise UsageError(f"{self.path} holds responses generated with other settings ({', '.join(differing)}); "
                             "rerun with --overwrite to regenerate from scratch, or use another --output-dir")

    def remove(self) -> None:
        for path in (self.path, self.settings_path):
            if path.exists():
                path.unlink()

    def load(self) -> dict[str, dict]:
        entries: dict[str, dict] = {}
        if not self.path.exists():
            return entries
        with open(self.path, "rb") as handle:
            for raw in handle:
                try:
                    entry = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue  # a line torn by a kill; that conversation is generated again
                if isinstance(entry, dict) and "id" in entry:
                    entries[str(entry["id"])] = entry
        return entries

    def _repair_torn_tail(self) -> None:
        """Cut a last line left incomplete by a kill, so the next append starts on a fresh line."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as handle:
            data = handle.read()
            if not data.endswith(b"\n"):
                handle.truncate(data.rfind(b"\n") + 1)

    def append(self, entries: Sequence[dict]) -> None:
        if not self.settings_path.exists():
            from eagle3_pipeline.formats.files import write_json_atomic

            write_json_atomic(self.settings_path, self.settings)
        self._repair_torn_tail()
        with open(self.path, "a", encoding="utf-8") as handle:
            for entry in entries:
                handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


# --- the turn-by-turn driver --------------------------------------------------------------------------

@dataclass
class _Conversation:
    id: str
    segments: list[list[dict]]
    history: list[dict]
    next_segment: int = 0
    bad: tuple[str, str] | None = None

    @property
    def pending(self) -> bool:
        return self.bad is None and self.next_segment < len(self.segments)


def _generate_batch(batch: list[_Conversation], respond: Responder) -> None:
    """Run every conversation of the batch to its end, one turn (one responder call) at a time.

    A responder with a `failure_reason` (reason, detail) means None as "the request failed": that
    conversation is marked bad on any turn (to be asked again next run), not cut short.
    """
    failure = getattr(respond, "failure_reason", None)
    while True:
        active = [c for c in batch if c.pending]
        if not active:
            return
        prompts = [c.history + c.segments[c.next_segment] for c in active]
        replies = respond(prompts)
        if len(replies) != len(prompts):
            raise RuntimeError(f"the responder returned {len(replies)} replies for {len(prompts)} prompts")
        for conversation, prompt, reply in zip(active, prompts, replies):
            text = None if reply is None else reply.strip()
            if reply is None and failure is not None:
                conversation.bad = failure
                continue
            if not text:
                if conversation.next_segment == 0:
                    conversation.bad = ("no_reply", "prompt too long or not renderable") if reply is None \
                        else ("empty_generation", "the verifier's first reply is empty")
                else:  # keep the turns generated so far; the conversation ends before this user turn
                    conversation.segments = conversation.segments[:conversation.next_segment]
                continue
            conversation.history = prompt + [{"role": ASSISTANT, "content": text}]
            conversation.next_segment += 1


def regenerate_conversations(conversations: Sequence[Any], respond: Responder, cache: RegenerationCache,
                             batch_size: int, desc: str = "regenerate") -> tuple[dict[str, dict], dict[str, int]]:
    """Completed conversations {id: cache entry} for objects with .id and .messages, and counts.

    Entries already in the cache for the same prompts are reused; the rest are generated in batches
    of `batch_size` conversations, sorted by turn count and prompt length so batches pad little.
    """
    cached = cache.load()
    results: dict[str, dict] = {}
    todo: list[_Conversation] = []
    for conversation in conversations:
        digest = prompts_hash(conversation.messages)
        entry = cached.get(conversation.id)
        if entry is not None and entry.get("prompts_sha256") == digest and entry.get("bad") != ENDPOINT_FAILED:
            results[conversation.id] = entry
        else:
            todo.append(_Conversation(conversation.id, prompt_segments(conversation.messages), []))
    reused = len(results)
    digests = {c.id: prompts_hash(c.messages) for c in conversations}
    todo.sort(key=lambda c: (len(c.segments), sum(len(m["content"]) for s in c.segments for m in s)))
    if reused:
        get_logger().info("%s: reusing %d conversation(s) already generated in %s", desc, reused, cache.path)
    if not todo:
        return results, {"reused": reused, "generated": 0}
    progress = RegenerationProgress(desc, [len(c.segments) for c in todo], batch_size,
                                    getattr(respond, "max_new_tokens", None))
    listen = getattr(respond, "listen", None)  # a responder that counts its decoding steps (HFResponder)
    if listen is not None:
        listen(progress.on_step)
    try:
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            progress.batch_started(start // batch_size)
            _generate_batch(batch, respond)
            entries = []
            for c in batch:
                entry = {"id": c.id, "prompts_sha256": digests[c.id]}
                if c.bad is not None:
                    entry.update(bad=c.bad[0], detail=c.bad[1])
                else:
                    entry["messages"] = c.history
                entries.append(entry)
                results[c.id] = entry
            cache.append(entries)
            progress.batch_done(len(batch))
    finally:
        if listen is not None:
            listen(None)
        progress.close()
    return results, {"reused": reused, "generated": len(todo)}


def reply_id(conversation_id: str, index: int) -> str:
    """The id of a conversation's reply number `index`: the conversation's own id for the first (so caches
    made with one reply per prompt are reused), "ID#replyK" for the others. The cache is keyed by it, so a
    run killed half-way resumes reply by reply."""
    return conversation_id if index == 0 else f"{conversation_id}#reply{index}"


@dataclass
class _Reply:
    id: str
    messages: list[dict]


class Regenerator:
    """regenerate_conversations bound to one responder and cache, counting over calls (stage 01 uses it
    once per chunk of conversations). With `greedy_first`, each conversation's first reply is generated
    greedily and the others at the responder's temperature (--greedy-first-reply)."""

    def __init__(self, respond: Responder, cache: RegenerationCache, batch_size: int, greedy_first: bool = False):
        self.respond, self.cache, self.batch_size = respond, cache, batch_size
        self.greedy_first = greedy_first
        self.counts = {"reused": 0, "generated": 0}

    def __call__(self, conversations: Sequence[Any], replies: int = 1, desc: str = "regenerate") -> dict[str, dict]:
        """Cache entries keyed by reply_id(conversation id, k) for k < replies; `desc` names the progress lines."""
        expanded = [(k, _Reply(reply_id(c.id, k), c.messages)) for c in conversations for k in range(replies)]
        if self.greedy_first:
            runs = [([r for k, r in expanded if k == 0], AtTemperature(self.respond, 0.0), f"{desc} (greedy replies)"),
                    ([r for k, r in expanded if k > 0], self.respond, f"{desc} (sampled replies)")]
        else:
            runs = [([r for _, r in expanded], self.respond, desc)]
        results: dict[str, dict] = {}
        for batch, respond, run_desc in runs:
            if not batch:
                continue
            found, counts = regenerate_conversations(batch, respond, self.cache, self.batch_size, run_desc)
            results.update(found)
            for key, value in counts.items():
                self.counts[key] += value
        return results


class AtTemperature:
    """A responder (with a `temperature` attribute) that answers at another temperature for the length of each
    call, then goes back: the greedy replies of --greedy-first-reply come from the same loaded verifier."""

    def __init__(self, respond: Responder, temperature: float):
        self.respond, self.temperature = respond, temperature

    def __call__(self, conversations: list[list[dict]]) -> list[str | None]:
        own = self.respond.temperature
        self.respond.temperature = self.temperature
        try:
            return self.respond(conversations)
        finally:
            self.respond.temperature = own

    def __getattr__(self, name: str):  # failure_reason and the like, as the responder has them
        return getattr(self.respond, name)
