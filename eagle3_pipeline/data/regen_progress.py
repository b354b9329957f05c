"""Stage 01's regeneration progress: tokens generated, conversations finished, batches, and an ETA from the share of
the decoding work done (docs/data.md, "Progress of a regeneration").

The work is counted in token steps: one reply's place in one decoding step. A batch decodes until its longest reply
stops or reaches --max-new-tokens, so a reply costs at most --max-new-tokens token steps and the work is bounded by
replies x --max-new-tokens; a batch that ends early lowers that bound. The ETA is the bound left over the pace of
the steps already done, so it falls as replies stop early and does not climb while tokens flow at a steady pace.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from eagle3_pipeline.progress import Progress
from eagle3_pipeline.log import get_logger

# listener(token_steps, tokens): increments as a batch decodes
StepListener = Callable[[int, int], None]


class StepTally:
    """One batch's decoding as it advances, passed on to a listener as increments: a transformers streamer (put
    gets the prompts, then each step's tokens), cumulative counts from a decoding loop (`at`), and whatever was not
    yet passed on once the batch's rows are known (`finish`)."""

    def __init__(self, listener: StepListener | None, rows: int, stop_ids: set[int]):
        import torch

        self.listener, self.rows, self.stop_ids = listener, rows, stop_ids
        self.stopped = torch.zeros(rows, dtype=torch.bool)  # on the host, where generate hands each step's tokens
        self.stops = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self.steps = 0   # passed on so far
        self.tokens = 0

    def put(self, value) -> None:
        """A streamer's call: the prompts first ([rows, width], skipped), then one token per row each step."""
        import torch

        if value.dim() != 1 or self.listener is None:
            return
        live = ~self.stopped  # a row that stopped gets pads: not generated tokens
        self.stopped |= live & torch.isin(value.cpu(), self.stops)
        self.at(self.steps + 1, self.tokens + int(live.sum()))

    def end(self) -> None:
        """A streamer's last call: nothing to do, `finish` counts from the rows themselves."""

    def at(self, steps: int, tokens: int) -> None:
        """The batch has run `steps` decoding steps and generated `tokens` tokens in all (up to each stop id)."""
        if self.listener is not None and (steps, tokens) != (self.steps, self.tokens):
            self.listener(self.rows * (steps - self.steps), tokens - self.tokens)
        self.steps, self.tokens = steps, tokens

    def finish(self, rows: Sequence[Sequence[int]]) -> None:
        """The batch's generated rows: what the steps did not pass on yet (an engine without a streamer)."""
        steps = max((len(row) for row in rows), default=0)
        tokens = sum(next((i + 1 for i, t in enumerate(row) if t in self.stop_ids), len(row)) for row in rows)
        self.at(max(steps, self.steps), max(tokens, self.tokens))


class RegenerationProgress:
    """The progress line of one regeneration run (a split's round): token steps done of at most the bound left,
    with tokens generated, conversations finished and the batch in hand. `turns` holds each conversation's
    number of replies to generate, in the order the batches take them; `reply_budget` is --max-new-tokens (None
    for a responder that does not say it: the line then counts conversations)."""

    def __init__(self, desc: str, turns: Sequence[int], batch_size: int, reply_budget: int | None):
        self.turns, self.batch_size, self.reply_budget = list(turns), batch_size, reply_budget
        self.batches = -(-len(self.turns) // batch_size)
        self.conversations_done = 0
        self.batch = 0
        self.tokens = 0
        self._first_step: tuple[float, int] | None = None  # (time, tokens) at the first step counted
        self._stepped = False  # the batch in hand reported steps (an endpoint reports none)
        self._lock = threading.Lock()
        total = sum(self.turns) * reply_budget if reply_budget else len(self.turns)
        unit = "token steps" if reply_budget else "conv"
        self.progress = Progress(total=total, desc=desc, unit=unit, detail=self.detail)
        if reply_budget:
            get_logger().info("%s: %d conversation(s) in %d batch(es) of up to %d, shortest prompts first; at most "
                              "%d token steps (a reply's place in a decoding step, %d a reply): the ETA assumes every "
                              "batch runs to --max-new-tokens, so it falls when replies stop earlier", desc,
                              len(self.turns), self.batches, batch_size, total, reply_budget)

    def on_step(self, token_steps: int, tokens: int) -> None:
        """A StepTally's listener (called from the responder's threads)."""
        with self._lock:
            if self._first_step is None:
                self._first_step = (time.time(), self.tokens)
            self.tokens += tokens
            self._stepped = True
        self.progress.update(token_steps)

    def batch_started(self, index: int) -> None:
        with self._lock:
            self.batch, self._stepped = index + 1, False

    def batch_done(self, conversations: int) -> None:
        """The batch in hand finished: the bound left is what the later batches may take."""
        first = (self.batch - 1) * self.batch_size
        with self._lock:
            self.conversations_done += conversations
            stepped = self._stepped
        if not self.reply_budget:
            self.progress.update(conversations)
            return
        if not stepped:  # no step counts (an endpoint): the batch's bound is its work
            self.progress.update(sum(self.turns[first:first + conversations]) * self.reply_budget)
        left = sum(self.turns[first + conversations:]) * self.reply_budget
        self.progress.set_total(self.progress.count + left)

    def detail(self) -> str:
        """Tokens, conversations and the batch, for each line."""
        with self._lock:
            tokens, first, done, batch = self.tokens, self._first_step, self.conversations_done, self.batch
        parts = []
        if self.reply_budget and first is not None:
            seconds = time.time() - first[0]
            rate = f" ({(tokens - first[1]) / seconds:.1f}/s)" if seconds > 0 else ""
            parts.append(f"{tokens:,} tokens generated{rate}")
        parts.append(f"{done}/{len(self.turns)} conversations done")
        if batch:
            parts.append(f"batch {batch} of {self.batches}{self._batch_note(batch)}")
        return ", ".join(parts)

    def _batch_note(self, batch: int) -> str:
        """Why the last batch is smaller: the rest of the conversations, the longest prompts."""
        size = len(self.turns) - (batch - 1) * self.batch_size
        if batch == self.batches and self.batches > 1 and size < self.batch_size:
            return f" (the last {size} conversation(s): the longest prompts)"
        return ""

    def close(self) -> None:
        self.progress.close()
