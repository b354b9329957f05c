"""Benchmark a running server (SGLang, or any OpenAI-compatible one): HTTP client, conversations, accept length.

Where the accept length comes from, in order of preference, and which of SGLang's own acceptance fields are read and
reported: docs/benchmarking.md ("Server mode").
"""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from eagle3_pipeline.bench.metrics import acceptance_by_position, latency_summary
from eagle3_pipeline.bench.vllm_metrics import read_counters, vllm_acceptance
from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.data.prompt_files import BenchPrompt

RETRY_STATUS = (429, 500, 502, 503, 504)
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")  # current route first, then the older one
# SGLang's per-request acceptance histogram (index k: verify steps that accepted k drafts, bonus token not counted).
# 0.5.23 sends only the first name; 0.5.17 sends both, the second as a backward-compatible alias.
HISTOGRAM_KEYS = ("spec_correct_drafts_histogram", "spec_accept_histogram")


class ServerError(RuntimeError):
    """A request that failed after its retries."""


def _request(method: str, url: str, body: dict | None, timeout: float) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        payload = response.read()
    return json.loads(payload) if payload else {}


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 600.0, retries: int = 4,
              backoff: float = 0.5, sleep: Callable[[float], None] = time.sleep) -> dict:
    """JSON request with retries on transient failures (connection errors, timeouts, 429 and 5xx)."""
    last_error: Exception | None = None
    for attempt in range(retries + 1):
        try:
            return _request(method, url, body, timeout)
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300] if err.fp is not None else ""
            if err.code not in RETRY_STATUS:
                raise ServerError(f"{method} {url}: HTTP {err.code} {err.reason}: {detail}") from err
            last_error = ServerError(f"{method} {url}: HTTP {err.code} {err.reason}: {detail}")
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as err:
            last_error = err
        except json.JSONDecodeError as err:
            raise ServerError(f"{method} {url}: the reply is not JSON ({err})") from err
        if attempt < retries:
            sleep(backoff * (2 ** attempt))
    raise ServerError(f"{method} {url}: failed after {retries + 1} attempts: {last_error}")


def check_reachable(url: str, flag: str = "--url", timeout: float = 10.0) -> dict:
    """GET /v1/models once (with two quick retries) before any prompt is sent; a clear error if down."""
    try:
        return http_json("GET", url.rstrip("/") + "/v1/models", timeout=timeout, retries=2, backoff=0.5)
    except ServerError as err:
        if "HTTP 404" in str(err):
            return {}  # the server answers, just not with an OpenAI model list
        raise UsageError(f"{flag} {url}: the server is not reachable ({err}). Start it first, e.g. "
                         f"python -m sglang.launch_server --model-path M --speculative-algorithm EAGLE3 "
                         f"--speculative-draft-model-path RUN_DIR/checkpoints/best ..., and check host and port")


def served_model_name(models: dict) -> str:
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return "default"


def server_info(url: str) -> dict | None:
    for path in SERVER_INFO_PATHS:
        try:
            return http_json("GET", url.rstrip("/") + path, timeout=30.0, retries=1, backoff=0.2)
        except ServerError:
            continue
    return None


def avg_spec_accept_length(info: dict | None) -> float | None:
    """avg_spec_accept_length at the top level (older SGLang) or under internal_states[0] (newer)."""
    if not isinstance(info, dict):
        return None
    value = info.get("avg_spec_accept_length")
    states = info.get("internal_states")
    if value is None and isinstance(states, list) and states and isinstance(states[0], dict):
        value = states[0].get("avg_spec_accept_length")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


# --- one conversation --------------------------------------------------------------------------------

@dataclass
class TurnResult:
    prompt_id: str
    turn: int
    category: str | None
    latency_s: float
    completion_tokens: int
    text: str
    spec_verify_ct: int | None = None
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_accept_histogram: list[int] | None = None
    meta_keys: list[str] = field(default_factory=list)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _float_or_none(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def accept_histogram_of(meta: dict) -> list[int] | None:
    """The request's acceptance histogram under either of SGLang's names, or None when absent or malformed."""
    for key in HISTOGRAM_KEYS:
        value = meta.get(key)
        if isinstance(value, list) and value:
            try:
                return [int(count) for count in value]
            except (TypeError, ValueError):
                return None
    return None


def spec_fields(meta: dict) -> dict[str, Any]:
    """The speculative-decoding fields of one reply's meta_info; None for each one the server did not send."""
    return {"spec_verify_ct": _int_or_none(meta.get("spec_verify_ct")),
            "spec_accept_length": _float_or_none(meta.get("spec_accept_length")),
            "spec_accept_rate": _float_or_none(meta.get("spec_accept_rate")),
            "spec_accept_histogram": accept_histogram_of(meta)}


def parse_chat_response(reply: dict) -> tuple[str, int, dict]:
    """(text, completion_tokens, meta_info) of a /v1/chat/completions reply."""
    choices = reply.get("choices") or []
    if not choices:
        raise ServerError(f"chat completion without choices: {str(reply)[:300]}")
    choice = choices[0]
    text = (choice.get("message") or {}).get("content") or ""
    meta = choice.get("meta_info") or reply.get("meta_info") or {}
    usage = reply.get("usage") or {}
    tokens = _int_or_none(usage.get("completion_tokens"))
    if tokens is None:
        tokens = _int_or_none(meta.get("completion_tokens"))
    if tokens is None:
        raise ServerError("the reply has no usage.completion_tokens; cannot measure output tokens")
    return text, tokens, meta


def parse_completion_response(reply: dict) -> tuple[str, int, dict]:
    """(text, completion_tokens, {}) of a /v1/completions reply."""
    choices = reply.get("choices") or []
    tokens = _int_or_none((reply.get("usage") or {}).get("completion_tokens"))
    if not choices or tokens is None:
        raise ServerError(f"a completion without choices or usage.completion_tokens: {str(reply)[:300]}")
    return choices[0].get("text") or "", tokens, choices[0].get("meta_info") or {}


def parse_generate_response(reply: Any) -> tuple[str, int, dict]:
    """(text, completion_tokens, meta_info) of an SGLang /generate reply."""
    if isinstance(reply, list):
        reply = reply[0]
    meta = reply.get("meta_info") or {}
    tokens = _int_or_none(meta.get("completion_tokens"))
    if tokens is None:
        raise ServerError("the /generate reply has no meta_info.completion_tokens")
    return reply.get("text", ""), tokens, meta


class ServerClient:
    """Sends one conversation's turns through /v1/chat/completions, /v1/completions or SGLang's /generate."""

    def __init__(self, url: str, api: str, model: str, max_new_tokens: int, temperature: float, top_p: float,
                 render: Callable[[list[dict]], list[int]] | None = None, timeout: float = 600.0):
        if api in ("generate", "completions") and render is None:
            raise UsageError(f"--server-api {api} sends token ids and needs --model-path for the tokenizer "
                             "(and its chat template)")
        self.url, self.api, self.model = url.rstrip("/"), api, model
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.render, self.timeout = render, timeout

    def send(self, messages: list[dict]) -> tuple[str, int, dict]:
        if self.api == "chat":
            body = {"model": self.model, "messages": messages, "max_tokens": self.max_new_tokens,
                    "temperature": self.temperature, "top_p": self.top_p, "stream": False,
                    "return_meta_info": True}
            return parse_chat_response(http_json("POST", self.url + "/v1/chat/completions", body, self.timeout))
        if self.api == "completions":
            body = {"model": self.model, "prompt": self.render(messages), "max_tokens": self.max_new_tokens,
                    "temperature": self.temperature, "top_p": self.top_p, "stream": False}
            return parse_completion_response(http_json("POST", self.url + "/v1/completions", body, self.timeout))
        body = {"input_ids": self.render(messages),
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                    "top_p": self.top_p}}
        return parse_generate_response(http_json("POST", self.url + "/generate", body, self.timeout))

    def conversation(self, prompt: BenchPrompt) -> list[TurnResult]:
        messages: list[dict] = []
        results = []
        for turn, text in enumerate(prompt.turns):
            messages.append({"role": "user", "content": text})
            started = time.perf_counter()
            answer, tokens, meta = self.send(messages)
            latency = time.perf_counter() - started
            messages.append({"role": "assistant", "content": answer})
            results.append(TurnResult(prompt.id, turn, prompt.category, latency, tokens, answer,
                                      meta_keys=sorted(meta), **spec_fields(meta)))
        return results


# --- a whole run -------------------------------------------------------------------------------------

def accept_length_of(turns: Sequence[TurnResult], info_value: float | None,
                     vllm: dict | None = None) -> tuple[float | None, str | None]:
    counted = [t for t in turns if t.spec_verify_ct]
    if counted:
        value = sum(t.completion_tokens for t in counted) / sum(t.spec_verify_ct for t in counted)
        return value, f"per-request meta_info: completion_tokens / spec_verify_ct over {len(counted)} requests"
    reported = [t.spec_accept_length for t in turns if t.spec_accept_length is not None]
    if reported:
        return sum(reported) / len(reported), f"per-request meta_info spec_accept_length over {len(reported)} requests"
    if info_value is not None:
        return info_value, "GET /server_info avg_spec_accept_length (running average since server start)"
    if vllm and vllm["mean_acceptance_length"] is not None:
        return vllm["mean_acceptance_length"], ("GET /metrics: vLLM's 1 + accepted / drafts "
                                                 f"over this run's {vllm['drafts']} verify steps")
    return None, None


def summed_histogram(histograms: Sequence[Sequence[int]]) -> list[int]:
    """Per-request histograms added up; a request's list is only as long as its most accepted drafts."""
    total = [0] * max(len(histogram) for histogram in histograms)
    for histogram in histograms:
        for accepted, steps in enumerate(histogram):
            total[accepted] += steps
    return total


def histogram_accept_lengths(histogram: Sequence[int]) -> list[int]:
    """One entry per verify step: the tokens it produced (accepted drafts + the bonus), as offline mode records."""
    return [accepted + 1 for accepted, steps in enumerate(histogram) for _ in range(steps)]


def sglang_acceptance(turns: Sequence[TurnResult]) -> dict[str, Any]:
    """SGLang's own acceptance figures over the requests that carried them; None (and named in `absent`) where no
    reply carried the field. Meaning of each field: docs/benchmarking.md ("Server mode")."""
    verified = [t for t in turns if t.spec_verify_ct]
    lengths = [t.spec_accept_length for t in turns if t.spec_accept_length is not None]
    # The rate's denominator is verify steps x drafts per step, so the pooled rate weights requests by verify steps.
    rated = [t for t in verified if t.spec_accept_rate is not None]
    histograms = [t.spec_accept_histogram for t in turns if t.spec_accept_histogram]
    histogram = summed_histogram(histograms) if histograms else None
    steps = histogram_accept_lengths(histogram) if histogram else []
    absent = [name for name, present in (("spec_verify_ct", verified), ("spec_accept_length", lengths),
                                         ("spec_accept_rate", rated), ("/".join(HISTOGRAM_KEYS), histograms))
              if not present]
    return {
        "completion_tokens_per_verify_ct": (sum(t.completion_tokens for t in verified)
                                            / sum(t.spec_verify_ct for t in verified)) if verified else None,
        "mean_spec_accept_length": sum(lengths) / len(lengths) if lengths else None,
        "spec_accept_rate": (sum(t.spec_accept_rate * t.spec_verify_ct for t in rated)
                             / sum(t.spec_verify_ct for t in rated)) if rated else None,
        "histogram": histogram,
        "histogram_tau": sum(steps) / len(steps) if steps else None,
        # Positions up to the most drafts any verify step accepted: the server's draft count is not in the replies.
        "acceptance": acceptance_by_position(steps, len(histogram) - 1) if histogram else None,
        "requests": {"spec_verify_ct": len(verified), "spec_accept_length": len(lengths),
                     "spec_accept_rate": len(rated), "histogram": len(histograms)},
        "absent": absent,
    }


def run_server_benchmark(url: str, prompts: Sequence[BenchPrompt], *, api: str, max_new_tokens: int,
                         temperature: float, top_p: float, concurrency: int,
                         render: Callable[[list[dict]], list[int]] | None = None, log=None,
                         flag: str = "--url", warmup: bool = True) -> dict[str, Any]:
    """Every prompt through the server at the given concurrency; throughput, latency and acceptance."""
    models = check_reachable(url, flag)
    client = ServerClient(url, api, served_model_name(models), max_new_tokens, temperature, top_p, render)
    if warmup:
        # One short request first, so the server's first-request costs (graph capture, caches) stay out.
        warm = ServerClient(url, api, client.model, min(16, max_new_tokens), temperature, top_p, render)
        warm.send([{"role": "user", "content": prompts[0].turns[0]}])
    info_before, counters_before = server_info(url), read_counters(url)
    done, failed, lock = [0], [], threading.Lock()

    def one(prompt: BenchPrompt) -> list[TurnResult]:
        try:
            result = client.conversation(prompt)
        except ServerError as err:  # after its retries: count it, keep measuring the others
            result = []
            with lock:
                failed.append({"prompt_id": prompt.id, "error": str(err)[:500]})
            if log is not None:
                log.warning("%s: prompt %s failed: %s", url, prompt.id, err)
        with lock:
            done[0] += 1
            if log is not None and (done[0] % max(1, len(prompts) // 10) == 0 or done[0] == len(prompts)):
                log.info("%s: %d/%d prompts answered", url, done[0], len(prompts))
        return result

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_prompt = list(pool.map(one, prompts))
    wall = time.perf_counter() - started
    info_after, counters_after = server_info(url), read_counters(url)
    vllm = vllm_acceptance(counters_before, counters_after)
    turns = [turn for conversation in per_prompt for turn in conversation]
    if not turns:
        raise ServerError(f"{url}: every prompt failed; first error: {failed[0]['error'] if failed else '?'}")
    tokens = sum(t.completion_tokens for t in turns)
    accept_length, source = accept_length_of(turns, avg_spec_accept_length(info_after), vllm)
    categories: dict[str, list[TurnResult]] = {}
    for turn in turns:
        if turn.category:
            categories.setdefault(turn.category, []).append(turn)
    return {
        "url": url,
        "api": api,
        "model": client.model,
        "requests": len(turns),
        "prompts": len(prompts),
        "failed_prompts": failed,
        "completion_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "latency_s": latency_summary([t.latency_s for t in turns]),
        "per_request_tokens_per_s": latency_summary([t.completion_tokens / t.latency_s for t in turns
                                                     if t.latency_s > 0]),
        "accept_length": accept_length,
        "accept_length_source": source,
        "sglang_acceptance": sglang_acceptance(turns),
        "vllm_acceptance": vllm,
        "server_info_avg_spec_accept_length": {"before": avg_spec_accept_length(info_before),
                                               "after": avg_spec_accept_length(info_after)},
        "categories": {name: {"requests": len(group), "accept_length": accept_length_of(group, None)[0]}
                       for name, group in sorted(categories.items())},
        "turns": [t.__dict__ for t in turns],
    }
