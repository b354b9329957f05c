"""Regenerating assistant turns with the verifier itself (stage 01 --regenerate).

A drafter learns to predict the verifier, so training on the verifier's own responses raises acceptance.
The user (and system) turns come from the data; each assistant turn is generated from the conversation so
far, turn by turn. Two layers:

  - a *responder*: any callable taking a list of conversations (message lists, each ending with a user
    turn) and returning one reply per conversation: the text, or None when no reply can be made (the
    prompt is too long). `HFResponder` runs batched `generate` on a transformers model;
    `EndpointResponder` asks an OpenAI-compatible server (e.g. SGLang serving the verifier).
  - `regenerate_conversations`: drives a responder over whole conversations in batches, appending each
    finished batch to a JSONL cache (flushed and synced per batch) so an interrupted run resumes where it
    stopped; ids already in the cache (for the same prompts) are not generated again.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from common.cli.errors import UsageError
from common.cli.stage import Progress, get_logger
from common.verifier.loading import inference_attention

ASSISTANT = "assistant"
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


def prompts_hash(messages: list[dict]) -> str:
    """Identity of what generation depends on in a conversation: its non-assistant turns."""
    payload = json.dumps(prompt_segments(messages), ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


# --- the resumable cache ---------------------------------------------------------------------------

class RegenerationCache:
    """regenerated.jsonl: one line per finished conversation, {"id", "prompts_sha256", "messages"} or
    {"id", "prompts_sha256", "bad": reason, "detail"}; the last line for an id wins."""

    def __init__(self, folder: str | os.PathLike, settings: dict[str, Any]):
        self.path = Path(folder) / CACHE_FILE
        self.settings_path = Path(folder) / SETTINGS_FILE
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
            from common.formats.files import write_json_atomic

            write_json_atomic(self.settings_path, self.settings)
        self._repair_torn_tail()
        with open(self.path, "a", encoding="utf-8") as handle:
            for entry in entries:
                handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


# --- the turn-by-turn driver ---------------------------------------------------------------------------

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
    with Progress(total=len(todo), desc=desc, unit="conv") as progress:
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
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
            progress.update(len(batch))
    return results, {"reused": reused, "generated": len(todo)}


# --- the transformers responder ----------------------------------------------------------------------

class HFResponder:
    """Batched `generate` on a transformers causal LM (left padding), loaded on first use.

    `load_model(device)` is called once per entry of `devices`, when the first prompt must actually be
    generated, so a run whose responses are all cached never loads the verifier. With several devices (one
    whole copy of the verifier on each GPU) the batches of a call are spread over the copies, each driven
    by its own thread: `generate` on a small verifier waits mostly on its GPU, so the copies overlap.
    """

    def __init__(self, load_model: Callable[[str], Any], tokenizer, stop_ids: set[int], max_new_tokens: int,
                 temperature: float, batch_size: int, max_prompt_tokens: int, seed: int = 0,
                 devices: Sequence[str] = ("cpu",)):
        self._load_model = load_model
        self.devices = list(devices)
        self.models: list[Any] = []
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.hit_max_new_tokens = 0
        # Any id works for padding (padded positions are masked out); left padding is done by hand.
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, min(stop_ids, default=0))
                           if i is not None)

    def _ensure_models(self) -> list[Any]:
        if not self.models:
            import torch

            get_logger().info("loading the verifier for regeneration on %s", ", ".join(self.devices))
            self.models = [self._load_model(device) for device in self.devices]
            torch.manual_seed(self.seed)
        return self.models

    def _render(self, conversation: list[dict]) -> str | None:
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - an unrenderable conversation gets no reply
            return None

    def __call__(self, conversations: list[list[dict]]) -> list[str | None]:
        texts = [self._render(c) for c in conversations]
        encoded = [None if t is None else list(self.tokenizer(t, add_special_tokens=False)["input_ids"])
                   for t in texts]
        replies: list[str | None] = [None] * len(conversations)
        usable = [i for i, ids in enumerate(encoded) if ids is not None and 0 < len(ids) < self.max_prompt_tokens]
        usable.sort(key=lambda i: len(encoded[i]))  # similar lengths together: less padding
        chunks = [usable[start:start + self.batch_size] for start in range(0, len(usable), self.batch_size)]
        for chunk, rows in zip(chunks, self._generate_all([[encoded[i] for i in chunk] for chunk in chunks])):
            for i, row in zip(chunk, rows):
                replies[i] = self._decode(row)
        return replies

    def _generate_all(self, batches: list[list[list[int]]]) -> list[list[list[int]]]:
        """Generated token rows of every batch, in order; with several copies, each batch goes to the next
        free one."""
        models = self._ensure_models()
        if len(models) == 1 or len(batches) == 1:
            return [self._generate(models[0], batch) for batch in batches]
        free: queue.Queue = queue.Queue()
        for model in models:
            free.put(model)

        def run(batch):
            model = free.get()
            try:
                return self._generate(model, batch)
            finally:
                free.put(model)

        # sdpa_kernel's backend choice is process-wide: set it once around all the threads.
        with inference_attention(), ThreadPoolExecutor(len(models), thread_name_prefix="regenerate") as pool:
            return list(pool.map(run, batches))

    def _generate(self, model, prompts: list[list[int]]) -> list[list[int]]:
        import torch
        from transformers import GenerationConfig

        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        pad = self.pad_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = self.temperature > 0
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=sampling,
                                  temperature=self.temperature if sampling else None,
                                  top_p=1.0 if sampling else None, top_k=0 if sampling else None,
                                  eos_token_id=sorted(self.stop_ids), pad_token_id=pad)
        on_gpu = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
        with on_gpu, torch.inference_mode(), inference_attention():
            output = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
        return output[:, width:].tolist()

    def _decode(self, row: list[int]) -> str:
        stop = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
        if stop is None:
            self.hit_max_new_tokens += 1
        return self.tokenizer.decode(row[:stop], skip_special_tokens=True).strip()


# --- the OpenAI-compatible endpoint responder ------------------------------------------------------------

def endpoint_base(url: str) -> str:
    """The server root: "http://host:port", "http://host:port/" and "http://host:port/v1" are the same."""
    base = url.strip().rstrip("/")
    return base[:-len("/v1")] if base.endswith("/v1") else base


def _is_transient(err: Exception) -> bool:
    """Worth retrying: the server is busy or restarting (5xx, 429) or the connection broke."""
    if isinstance(err, urllib.error.HTTPError):
        return err.code >= 500 or err.code == 429
    return isinstance(err, (urllib.error.URLError, ConnectionError, TimeoutError))


def check_endpoint(url: str, timeout_s: float = 10.0) -> str | None:
    """Preflight: the endpoint answers. Returns the served model name (first of GET /v1/models), or None
    when the server has no such route; raises UsageError naming the URL when nothing answers."""
    base = endpoint_base(url)
    if not base.startswith(("http://", "https://")):
        raise UsageError(f"--regenerate-endpoint {url!r}: expected an http(s) URL such as http://127.0.0.1:30000")
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=timeout_s) as response:
            listing = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError:
        return None  # it answered, just not this route: the chat route may still work
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise UsageError(f"--regenerate-endpoint {url}: no OpenAI-compatible server answers at {base}/v1/models "
                         f"({reason}); start the server (e.g. sglang.launch_server --model-path ...) or fix the URL")
    except json.JSONDecodeError:
        return None
    models = listing.get("data") if isinstance(listing, dict) else None
    if models and isinstance(models[0], dict) and models[0].get("id"):
        return str(models[0]["id"])
    return None


class EndpointResponder:
    """Replies from an OpenAI-compatible /v1/chat/completions, `concurrency` requests in flight.

    Transient failures (connection errors, 5xx, 429) are retried with exponential backoff; a
    conversation still failing gets None and is counted in `failures` (the first errors are logged).
    The server applies the chat template and stops at its end-of-turn tokens.
    """

    failure_reason = (ENDPOINT_FAILED, "the endpoint gave no reply after retries (see the log); asked again "
                                       "on the next run")
    LOGGED_ERRORS = 5

    def __init__(self, url: str, model: str | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                 concurrency: int = 1, retries: int = 3, timeout_s: float = 600, backoff_s: float = 0.5):
        self.url = endpoint_base(url) + "/v1/chat/completions"
        self.model = model or "default"
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.concurrency, self.retries, self.timeout_s, self.backoff_s = concurrency, retries, timeout_s, backoff_s
        self.failures = 0
        self.hit_max_new_tokens = 0
        self.errors: list[str] = []  # the first few, for the manifest
        self._lock = threading.Lock()

    def __call__(self, conversations: list[list[dict]]) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._respond, conversations))

    def _post(self, messages: list[dict]) -> dict:
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": self.max_new_tokens,
                           "temperature": self.temperature}).encode("utf-8")
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())

    def _respond(self, messages: list[dict]) -> str | None:
        for attempt in range(self.retries + 1):
            try:
                choice = self._post(messages)["choices"][0]
                reply = choice["message"]["content"]
            except Exception as err:  # noqa: BLE001 - every failure is either retried or counted
                if _is_transient(err) and attempt < self.retries:
                    time.sleep(self.backoff_s * 2 ** attempt)
                    continue
                self._record_failure(err, attempt + 1)
                return None
            if choice.get("finish_reason") == "length":
                with self._lock:
                    self.hit_max_new_tokens += 1
            return (reply or "").strip()
        return None  # not reached: the last attempt returns above

    def _record_failure(self, err: Exception, attempts: int) -> None:
        detail = f"{type(err).__name__}: {err}"
        if isinstance(err, urllib.error.HTTPError):
            try:
                detail += f" ({err.read()[:200].decode('utf-8', 'replace')})"
            except Exception:  # noqa: BLE001 - the body is only a hint
                pass
        with self._lock:
            self.failures += 1
            if len(self.errors) < self.LOGGED_ERRORS:
                self.errors.append(detail)
                get_logger().warning("%s: request failed after %d attempt(s): %s", self.url, attempts,
                                     detail)


class Regenerator:
    """regenerate_conversations bound to one responder and cache, counting over calls (stage 01 uses it
    once per chunk of conversations)."""

    def __init__(self, respond: Responder, cache: RegenerationCache, batch_size: int):
        self.respond, self.cache, self.batch_size = respond, cache, batch_size
        self.counts = {"reused": 0, "generated": 0}

    def __call__(self, conversations: Sequence[Any]) -> dict[str, dict]:
        results, counts = regenerate_conversations(conversations, self.respond, self.cache, self.batch_size)
        for key, value in counts.items():
            self.counts[key] += value
        return results
