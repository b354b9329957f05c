"""The quality checks of made user turns (stage 01 --synthesize): what is dropped, and why.

Each sampled user turn gets one verdict, in this order: empty, too_short, too_long (the turn did not end within
--synthesize-max-tokens), template_leak (a token the chat template writes, inside the user's words), looping
(too many repeated word 4-grams), excluded_prompt (it matches an --exclude-prompts prompt as stage 05's
overlap check does), exact_duplicate (the same normalised text as a kept turn at the same position),
near_duplicate (word 3-gram shingles whose Jaccard similarity with a kept turn's is at least
--near-duplicate-threshold; candidates found with MinHash and banded LSH, then checked exactly). Kept turns
are remembered, so later turns are compared against them; the same turns in the same order give the same
verdicts.
"""
from __future__ import annotations

import hashlib
import re
from collections import defaultdict

from eagle3_pipeline.data.records import normalise_prompt, text_prompt_hashes
from eagle3_pipeline.data.user_turns import UserTurnFormat

KEPT = "kept"
REASONS = ("empty", "too_short", "too_long", "template_leak", "looping", "excluded_prompt", "exact_duplicate",
           "near_duplicate")
MIN_CHARS = 10            # shorter user turns say too little to be worth an answer
LOOP_NGRAM = 4
MAX_REPEATED_SHARE = 0.3  # share of word 4-grams that repeat an earlier one, above which a turn loops
SHINGLE_WORDS = 3
# MinHash signature of BANDS x ROWS values; two texts of Jaccard similarity s share a band with probability
# 1 - (1 - s^ROWS)^BANDS: 0.99 at s = 0.7, 0.64 at s = 0.5 (pairs below the threshold are checked exactly).
BANDS, ROWS = 16, 4


def repeated_ngram_share(text: str, n: int = LOOP_NGRAM) -> float:
    """Share of the text's word n-grams that repeat an earlier one (0 for texts of fewer than 2n words)."""
    words = normalise_prompt(text).split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if len(words) < 2 * n:
        return 0.0
    return 1 - len(set(grams)) / len(grams)


def shingles(text: str, n: int = SHINGLE_WORDS) -> frozenset[int]:
    """The 64-bit hashes of the text's word n-grams, lowercased and without punctuation (the whole text when it
    has fewer words)."""
    words = re.findall(r"\w+", text.lower())
    grams = [" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))]
    return frozenset(int.from_bytes(hashlib.blake2b(g.encode("utf-8"), digest_size=8).digest(), "little")
                     for g in grams)


def _permutations(count: int) -> list[tuple[int, int]]:
    """Fixed odd multipliers and offsets of the multiply-shift hashes (the same in every run)."""
    values = []
    for i in range(count):
        digest = hashlib.blake2b(f"minhash-{i}".encode(), digest_size=16).digest()
        values.append((int.from_bytes(digest[:8], "little") | 1, int.from_bytes(digest[8:], "little")))
    return values


_PERMUTATIONS = _permutations(BANDS * ROWS)


def minhash(hashes: frozenset[int]) -> tuple[int, ...]:
    """The MinHash signature: per permutation, the least (a*x + b mod 2^64) >> 32 over the shingles (numpy's
    uint64 arithmetic wraps modulo 2^64)."""
    import numpy as np

    a, b = (np.array([p[k] for p in _PERMUTATIONS], dtype=np.uint64)[:, None] for k in (0, 1))
    x = np.array(sorted(hashes), dtype=np.uint64)[None, :]
    return tuple(int(v) for v in ((a * x + b) >> np.uint64(32)).min(axis=1))


def jaccard(a: frozenset[int], b: frozenset[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicates:
    """Kept texts' shingles, indexed by the bands of their MinHash signatures."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.kept: list[frozenset[int]] = []
        self.buckets: dict[tuple, list[int]] = defaultdict(list)

    def _bands(self, signature: tuple[int, ...]) -> list[tuple]:
        return [(band, signature[band * ROWS:(band + 1) * ROWS]) for band in range(BANDS)]

    def find(self, hashes: frozenset[int]) -> bool:
        """Whether a kept text is at least `threshold` similar."""
        candidates = {i for key in self._bands(minhash(hashes)) for i in self.buckets.get(key, ())}
        return any(jaccard(hashes, self.kept[i]) >= self.threshold for i in sorted(candidates))

    def add(self, hashes: frozenset[int]) -> None:
        for key in self._bands(minhash(hashes)):
            self.buckets[key].append(len(self.kept))
        self.kept.append(hashes)


class PromptFilters:
    """Verdicts on made user turns, remembering the kept ones per turn position (first turns against first
    turns, second against second)."""

    def __init__(self, fmt: UserTurnFormat, near_threshold: float, excluded: set[str]):
        self.fmt, self.near_threshold, self.excluded = fmt, near_threshold, excluded
        self.exact: dict[int, set[str]] = defaultdict(set)
        self.near: dict[int, NearDuplicates] = {}

    def verdict(self, text: str, ended: bool, turn: int) -> str:
        """KEPT or the reason (one of REASONS) the turn is dropped; a kept turn is remembered."""
        reason = self._quality(text, ended) or self._overlap(text, turn)
        if reason is None:
            self.remember(text, turn)
            return KEPT
        return reason

    def _quality(self, text: str, ended: bool) -> str | None:
        if not text:
            return "empty"
        if len(text) < MIN_CHARS:
            return "too_short"
        if not ended:
            return "too_long"
        if self.fmt.leaked(text) is not None:
            return "template_leak"
        if repeated_ngram_share(text) > MAX_REPEATED_SHARE:
            return "looping"
        return None

    def _overlap(self, text: str, turn: int) -> str | None:
        if self.excluded and not text_prompt_hashes(text).isdisjoint(self.excluded):
            return "excluded_prompt"
        if normalise_prompt(text) in self.exact[turn]:
            return "exact_duplicate"
        if self.near_threshold < 1.0 and self._near(turn).find(shingles(text)):
            return "near_duplicate"
        return None

    def _near(self, turn: int) -> NearDuplicates:
        if turn not in self.near:
            self.near[turn] = NearDuplicates(self.near_threshold)
        return self.near[turn]

    def remember(self, text: str, turn: int) -> None:
        """Count a kept turn (also one read back from an earlier run's rounds) for later comparisons."""
        self.exact[turn].add(normalise_prompt(text))
        if self.near_threshold < 1.0:
            self._near(turn).add(shingles(text))
