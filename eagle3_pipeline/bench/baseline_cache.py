"""The no-drafting baselines of each prompt, kept in a JSONL file so later runs reuse them."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence


class BaselineCache:
    """The no-drafting baselines of each prompt, kept in a JSONL file beside the reports.

    They depend on the verifier, the prompt and the sampling settings, never on the drafter or k, so a run
    at k=7 reuses what the run at k=3 measured on the same machine instead of decoding everything again
    (on a small verifier the two baselines are most of a benchmark's time). A line is appended as soon as
    a prompt's baselines are measured: an interrupted run keeps what it had.
    """

    def __init__(self, path: str | Path, context: dict[str, Any]):
        self.path = Path(path)
        self._context = json.dumps(context, sort_keys=True)
        self.entries: dict[str, dict] = {}
        self.hits = 0
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self.entries[entry["key"]] = entry
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash: that prompt is measured again

    def key(self, ids: Sequence[int], **settings: Any) -> str:
        text = json.dumps([self._context, list(ids), settings], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.hits += 1
        return entry

    def put(self, key: str, value: dict) -> None:
        entry = {"key": key, **value}
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")
