"""Conversations written by the verifier itself (stage 01 --synthesize; docs/data_engine.md).

Rounds of `round_size` conversations: in each, every open conversation gets its next user turn sampled from
the verifier (the conversation so far, then the template's opening of a user turn: eagle3_pipeline.data.user_turns),
the turn is checked (eagle3_pipeline.data.prompt_filters), and the kept ones get the verifier's reply from the same
responder --regenerate uses. Each round is seeded from --seed, its index and the turn, and is appended to
synthesized.jsonl whole: a killed run redoes only its unfinished round, the same way, and the filters'
memory of kept turns is rebuilt from the finished rounds, so the result is the same as an uninterrupted run.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.progress import Progress
from eagle3_pipeline.data.config import PrepareConfig, Regeneration, Synthesis
from eagle3_pipeline.data.prompt_filters import KEPT, PromptFilters
from eagle3_pipeline.data.records import ASSISTANT, USER, Record
from eagle3_pipeline.data.regenerate import RegenerationCache, prompts_hash
from eagle3_pipeline.data.user_turns import UserTurnFormat, user_turn_opening, user_turn_prefix
from eagle3_pipeline.formats.files import write_text_atomic

SYNTHESIS_FILE = "synthesized.jsonl"
SAMPLES_FILE = "synthesis_samples.md"
SOURCE = "synthesize"        # the source name made conversations carry
ROUND_BATCHES = 4            # a round holds this many regeneration batches of conversations
MAX_ROUNDS_FACTOR = 5        # rounds tried, as a multiple of those N conversations need when every one is kept
NOT_SAMPLED = "not_sampled"  # no turn came back: no room left in --max-seq-len, or the server failed
NO_REPLY = "no_reply"        # the verifier's reply to a kept turn was empty
KEPT_EXAMPLES, DROPPED_EXAMPLES = 20, 5


def conversation_id(index: int) -> str:
    return f"synth-{index:07d}"


def round_seed(seed: int, round_index: int, turn: int, role: str) -> int:
    """The torch seed of one sampling call: a round's user turns ("user") or replies ("reply") at `turn`."""
    digest = hashlib.sha256(f"{seed}:{round_index}:{turn}:{role}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class _Conversation:
    index: int
    messages: list[dict] = field(default_factory=list)
    sampled: list[dict] = field(default_factory=list)  # every sampled user turn: {"text", "verdict"}
    open: bool = True

    def entry(self, round_index: int) -> dict:
        return {"id": conversation_id(self.index), "round": round_index, "sampled": self.sampled,
                "messages": self.messages}


@dataclass
class Made:
    """What synthesis produced: the kept conversations and every count."""
    records: list[Record]
    verdicts: Counter          # user turns by verdict (KEPT or a drop reason), over all turns
    per_turn: list[Counter]    # the same, per turn position
    rounds: int
    reused_rounds: int
    entries: list[dict]        # every conversation of every round, for the samples file


class Synthesizer:
    """The round loop over a turn sampler (prompts as ids, seed -> rows) and a responder (conversations ->
    replies)."""

    def __init__(self, tokenizer, sampler, respond, filters: PromptFilters, fmt: UserTurnFormat,
                 cache: RegenerationCache, turns: int, round_size: int, seed: int):
        self.tokenizer, self.sampler, self.respond, self.filters, self.fmt = tokenizer, sampler, respond, filters, fmt
        self.cache, self.turns, self.round_size, self.seed = cache, turns, round_size, seed

    def run(self, wanted: int) -> Made:
        """Rounds until `wanted` conversations are kept (or MAX_ROUNDS_FACTOR times the rounds that takes)."""
        cached = self.cache.load()
        max_rounds = MAX_ROUNDS_FACTOR * max(1, math.ceil(wanted / self.round_size))
        entries: list[dict] = []
        kept = reused = 0
        progress = None
        round_index = 0
        try:
            while kept < wanted and round_index < max_rounds:
                found = self._cached_round(cached, round_index)
                replayed = found is not None
                if replayed:
                    reused += 1
                    self._replay(found)
                else:
                    if progress is None:
                        progress = Progress(total=wanted, desc="synthesize", unit="conv", initial=kept)
                    found = self._round(round_index)
                    self.cache.append(found)
                made_here = sum(1 for e in found if e["messages"])
                if not replayed:
                    progress.update(min(made_here, wanted - kept))
                entries.extend(found)
                kept += made_here
                round_index += 1
        finally:
            if progress is not None:
                progress.close()
        return self._made(entries, wanted, round_index, reused)

    def _cached_round(self, cached: dict[str, dict], round_index: int) -> list[dict] | None:
        """A round an earlier run finished (every one of its conversations written), else None."""
        ids = [conversation_id(round_index * self.round_size + i) for i in range(self.round_size)]
        found = [cached.get(i) for i in ids]
        if all(e is not None and e.get("round") == round_index for e in found):
            return found
        return None

    def _replay(self, entries: list[dict]) -> None:
        """The filters learn a finished round's kept turns, in the order they were first judged."""
        for entry in entries:
            for turn, sampled in enumerate(entry["sampled"]):
                if sampled["verdict"] == KEPT:
                    self.filters.remember(sampled["text"], turn)

    def _round(self, round_index: int) -> list[dict]:
        conversations = [_Conversation(round_index * self.round_size + i) for i in range(self.round_size)]
        for turn in range(self.turns):
            active = [c for c in conversations if c.open]
            if not active:
                break
            self._user_turns(active, round_index, turn)
            self._replies([c for c in active if c.open], round_index, turn)
        return [c.entry(round_index) for c in conversations]

    def _user_turns(self, active: list[_Conversation], round_index: int, turn: int) -> None:
        texts = [user_turn_prefix(self.tokenizer, c.messages) for c in active]
        prompts = [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        rows = self.sampler(prompts, round_seed(self.seed, round_index, turn, "user"))
        for conversation, row in zip(active, rows):
            text, ended = self.fmt.parse(self.tokenizer, row)
            verdict = NOT_SAMPLED if row is None else self.filters.verdict(text, ended, turn)
            conversation.sampled.append({"text": text, "verdict": verdict})
            if verdict == KEPT:
                conversation.messages.append({"role": USER, "content": text})
            else:
                conversation.open = False

    def _replies(self, asking: list[_Conversation], round_index: int, turn: int) -> None:
        if not asking:
            return
        reseed = getattr(self.respond, "reseed", None)
        if callable(reseed):
            reseed(round_seed(self.seed, round_index, turn, "reply"))
        replies = self.respond([c.messages for c in asking])
        for conversation, reply in zip(asking, replies):
            text = (reply or "").strip()
            if text:
                conversation.messages.append({"role": ASSISTANT, "content": text})
                continue
            conversation.open = False
            conversation.messages.pop()  # the turn without a reply goes; the turns before it stay
            conversation.sampled[-1]["verdict"] = NO_REPLY

    def _made(self, entries: list[dict], wanted: int, rounds: int, reused: int) -> Made:
        records, verdicts, per_turn = [], Counter(), [Counter() for _ in range(self.turns)]
        for entry in entries:
            for turn, sampled in enumerate(entry["sampled"]):
                verdicts[sampled["verdict"]] += 1
                per_turn[turn][sampled["verdict"]] += 1
            if entry["messages"] and len(records) < wanted:
                index = int(entry["id"].rsplit("-", 1)[1])
                records.append(Record(entry["id"], SOURCE, index + 1, messages=entry["messages"]))
        return Made(records, verdicts, per_turn, rounds, reused, entries)


# --- stage 01's use of it -----------------------------------------------------------------------------

def synthesis_settings(config: PrepareConfig, regeneration_settings: dict, excluded_sha: str | None,
                       round_size: int) -> dict:
    """What the made conversations depend on besides their number: a cache made with others is not extended."""
    synthesis = config.synthesis
    return {**regeneration_settings, "seed": config.seed, "synthesize_turns": synthesis.turns,
            "synthesize_temperature": synthesis.temperature, "synthesize_top_p": synthesis.top_p,
            "synthesize_max_tokens": synthesis.max_tokens,
            "near_duplicate_threshold": synthesis.near_duplicate_threshold, "excluded_prompts_sha256": excluded_sha,
            "greedy_first_reply": config.regeneration.greedy_first_reply, "round_size": round_size}


def make_sampler(synthesis: Synthesis, regeneration: Regeneration, tokenizer, regenerator, stop_ids: set[int]):
    """The user turns' sampler: through --regenerate-endpoint's /generate, or the verifier loaded here."""
    from eagle3_pipeline.data.turn_samplers import EndpointTurnSampler, InProcessTurnSampler

    options = (synthesis.max_tokens, synthesis.temperature, synthesis.top_p, stop_ids)
    if regeneration.endpoint:
        return EndpointTurnSampler(regeneration.endpoint, tokenizer, *options, concurrency=regeneration.concurrency)
    return InProcessTurnSampler(regenerator.respond, *options)


def synthesize(config: PrepareConfig, inputs, regenerator, regeneration_cache: RegenerationCache,
               stop_ids: set[int], log) -> tuple[list[Record], dict]:
    """--synthesize N: the made conversations (their replies handed to the regeneration cache, so the
    regenerator reuses them) and the manifest's "synthesis" section; writes SAMPLES_FILE."""
    from eagle3_pipeline.data.regenerate import AtTemperature

    synthesis = config.synthesis
    fmt = UserTurnFormat.of(inputs.tokenizer, stop_ids)
    filters = PromptFilters(fmt, synthesis.near_duplicate_threshold, inputs.excluded_prompts)
    round_size = ROUND_BATCHES * regenerator.batch_size
    excluded_sha = inputs.fingerprint.get("excluded_prompts_sha256")
    cache = RegenerationCache(inputs.out, synthesis_settings(config, regeneration_cache.settings, excluded_sha,
                                                             round_size), SYNTHESIS_FILE)
    if config.outputs.overwrite and cache.differences():
        log.info("--overwrite: removing %s (made with other settings)", cache.path)
        cache.remove()
    cache.check_settings()
    greedy_first = config.regeneration.greedy_first_reply
    respond = AtTemperature(regenerator.respond, 0.0) if greedy_first else regenerator.respond
    opening = user_turn_opening(inputs.tokenizer)
    log.info("synthesize: %d conversation(s) of up to %d user turn(s), in rounds of %d; user turns open with "
             "%r (from the chat template) and are sampled at temperature %g, top-p %g", synthesis.count,
             synthesis.turns, round_size, opening, synthesis.temperature, synthesis.top_p)
    sampler = make_sampler(synthesis, config.regeneration, inputs.tokenizer, regenerator, set(fmt.stop_ids))
    made = Synthesizer(inputs.tokenizer, sampler, respond, filters, fmt, cache, synthesis.turns, round_size,
                       config.seed).run(synthesis.count)
    hand_to_regeneration(made.records, regeneration_cache)
    section = summary(synthesis.count, made, opening, cache)
    write_samples(inputs.out / SAMPLES_FILE, made)
    log_summary(section, log)
    return made.records, section


def hand_to_regeneration(records: list[Record], cache: RegenerationCache) -> None:
    """Each made conversation's replies into the regeneration cache, under its id, where not there already."""
    present = cache.load()
    new = [{"id": r.id, "prompts_sha256": prompts_hash(r.messages), "messages": r.messages} for r in records
           if present.get(r.id, {}).get("prompts_sha256") != prompts_hash(r.messages)
           or "messages" not in present.get(r.id, {})]
    if new:
        cache.append(new)


def summary(asked: int, made: Made, opening: str, cache: RegenerationCache) -> dict:
    turns = Counter(sum(m["role"] == USER for m in r.messages) for r in made.records)
    return {"asked": asked, "made": len(made.records), "rounds": made.rounds,
            "reused_rounds": made.reused_rounds, "user_turn_opening": opening,
            "user_turns": {"sampled": sum(made.verdicts.values()), "kept": made.verdicts[KEPT],
                           "dropped": {k: v for k, v in made.verdicts.most_common() if k != KEPT},
                           "per_turn": [dict(c.most_common()) for c in made.per_turn]},
            "conversations_by_user_turns": {str(k): turns[k] for k in sorted(turns)},
            "cache": cache.path.name, "samples": SAMPLES_FILE, "settings": cache.settings}


def log_summary(section: dict, log) -> None:
    turns = section["user_turns"]
    log.info("synthesize: %d conversation(s) made of %d asked (%d round(s), %d from an earlier run); user turns "
             "sampled %d, kept %d; dropped by reason: %s; samples in %s", section["made"], section["asked"],
             section["rounds"], section["reused_rounds"], turns["sampled"], turns["kept"],
             ", ".join(f"{k} {v}" for k, v in turns["dropped"].items()) or "none", section["samples"])
    if section["made"] < section["asked"]:
        log.warning("synthesize: only %d of %d conversations were kept after %d rounds: most sampled turns were "
                    "dropped (reasons above; %s shows examples)", section["made"], section["asked"],
                    section["rounds"], section["samples"])


def write_samples(path: Path, made: Made) -> None:
    """A page for a person: the first kept conversations' user turns, and examples of each drop reason."""
    lines = ["# Made conversations: kept and dropped user turns", "",
             f"Kept: the first {KEPT_EXAMPLES} made conversations' user turns. Dropped: up to {DROPPED_EXAMPLES} "
             "turns per reason (docs/data_engine.md says what each reason means).", "", "## Kept", ""]
    for record in made.records[:KEPT_EXAMPLES]:
        turns = [m["content"] for m in record.messages if m["role"] == USER]
        lines.append(f"- {record.id}: " + " / ".join(json.dumps(t, ensure_ascii=False) for t in turns))
    dropped: dict[str, list[str]] = {}
    for entry in made.entries:
        for turn, sampled in enumerate(entry["sampled"]):
            if sampled["verdict"] != KEPT and len(dropped.setdefault(sampled["verdict"], [])) < DROPPED_EXAMPLES:
                dropped[sampled["verdict"]].append(f"- {entry['id']} turn {turn + 1}: "
                                                   f"{json.dumps(sampled['text'][:500], ensure_ascii=False)}")
    for reason in sorted(dropped):
        lines += ["", f"## Dropped: {reason}", "", *dropped[reason]]
    write_text_atomic(path, "\n".join(lines) + "\n")
