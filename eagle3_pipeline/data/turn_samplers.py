"""Sampling token continuations for --synthesize's user turns: the in-process verifier's engines
(eagle3_pipeline.data.responders.HFResponder, with the user turns' own length, temperature, top-p and stop ids), or a
server's SGLang-style /generate with token ids. Both take prompts as token ids and return generated token ids,
so the template's own tokens inside a turn stay visible to the leak check.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from eagle3_pipeline.log import get_logger
from eagle3_pipeline.data.responders import RequestFailed, endpoint_base, post_json


@contextmanager
def _settings(responder, **values):
    """The responder's attributes set to `values` for the length of the block, then back."""
    own = {name: getattr(responder, name) for name in values}
    for name, value in values.items():
        setattr(responder, name, value)
    try:
        yield responder
    finally:
        for name, value in own.items():
            setattr(responder, name, value)


class InProcessTurnSampler:
    """User turns from the verifier stage 01 loaded (the same copy that writes the replies)."""

    def __init__(self, responder, max_new_tokens: int, temperature: float, top_p: float, stop_ids: set[int]):
        self.responder = responder
        self.values = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                       "stop_ids": set(stop_ids)}

    def __call__(self, prompts: list[list[int]], seed: int) -> list[list[int] | None]:
        with _settings(self.responder, **self.values) as responder:
            responder.reseed(seed)
            return responder.continue_tokens(prompts)


class EndpointTurnSampler:
    """User turns from POST /generate {"input_ids", "sampling_params"} (SGLang's native route), `concurrency`
    requests in flight; transient failures retried with backoff, a request still failing gives None. Each
    request carries its own `sampling_seed` (seed + row), which SGLang honours where its sampler is
    deterministic; the generated ids come from "output_ids", else the text is tokenized here."""

    def __init__(self, url: str, tokenizer, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: set[int], concurrency: int = 1, retries: int = 3, timeout_s: float = 600,
                 backoff_s: float = 0.5):
        self.url = endpoint_base(url) + "/generate"
        self.tokenizer = tokenizer
        self.params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                       "stop_token_ids": sorted(stop_ids), "skip_special_tokens": False}
        self.concurrency, self.retries, self.timeout_s, self.backoff_s = concurrency, retries, timeout_s, backoff_s
        self.failures = 0

    def __call__(self, prompts: list[list[int]], seed: int) -> list[list[int] | None]:
        jobs = [(ids, seed + i) for i, ids in enumerate(prompts)]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(lambda job: self._sample(*job), jobs))

    def _ids_of(self, out: dict) -> list[int]:
        if out.get("output_ids") is not None:
            return [int(t) for t in out["output_ids"]]
        return list(self.tokenizer(out["text"], add_special_tokens=False)["input_ids"])

    def _sample(self, ids: list[int], seed: int) -> list[int] | None:
        payload = {"input_ids": ids, "sampling_params": {**self.params, "sampling_seed": seed}}
        try:
            return post_json(self.url, payload, self.timeout_s, self._ids_of, self.retries, self.backoff_s)
        except RequestFailed as failed:
            self.failures += 1
            get_logger().warning("%s: request failed after %d attempt(s): %s", self.url, failed.attempts, failed)
            return None
