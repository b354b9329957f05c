"""Responders for --regenerate: a transformers verifier run in-process, or an OpenAI-compatible endpoint.

A responder takes a list of conversations (each ending with a user turn) and returns one reply per
conversation: the text, or None when no reply can be made.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable, Sequence

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.data.regen_progress import StepListener, StepTally
from eagle3_pipeline.data.regenerate import ENDPOINT_FAILED
from eagle3_pipeline.data.static_cache import (StaticCachePool, generate_cache_keyword, static_batches, static_rows,
                                               static_width)
from eagle3_pipeline.model.kernels import sdpa_without_cudnn


# --- the transformers responder ----------------------------------------------------------------------

# How HFResponder runs the verifier (docs/data.md, "Regeneration engines"): "static" = `generate` with a
# static KV cache, which transformers compiles on a GPU, decoding with eagle3_pipeline.verifier.decode_attention;
# "continuous" = transformers' continuous batching (`generate_batch`, a paged cache); "generate" = plain
# batched `generate` with a dynamic cache (the first engine, kept as the reference and the fallback);
# "loop" = our own decoding loop over the same pooled static caches, without `generate`
# (eagle3_pipeline.data.decode_loop; measured once on an H200, not yet side by side with "static", so "auto" does not
# pick it).
ENGINES = ("static", "loop", "continuous", "generate")
DEFAULT_ENGINE = "auto"  # static on a GPU; generate on a CPU, where the static cache is slower (docs/data.md)


def resolve_engine(engine: str, devices: Sequence[str]) -> str:
    """The engine "auto" stands for on these devices."""
    if engine != "auto":
        return engine
    return "static" if any(str(device).startswith("cuda") for device in devices) else "generate"


def synchronized_clock(device) -> float:
    """time.perf_counter() once the device has done its queued work (a CUDA synchronize; nothing on a CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- HFResponder -------------------------------------------------------------------------------------

class HFResponder:
    """Batched `generate` on a transformers causal LM (left padding), loaded on first use.

    `load_model(device)` is called once per entry of `devices`, when the first prompt must actually be
    generated, so a run whose responses are all cached never loads the verifier. With several devices (one
    whole copy of the verifier on each GPU) the batches of a call are spread over the copies, each driven
    by its own thread: `generate` on a small verifier waits mostly on its GPU, so the copies overlap.
    With the "continuous" engine a call's prompts are split evenly over the copies instead of into
    `batch_size` chunks: the library schedules them itself, requests joining as others finish. With
    "static" and "loop", `batch_size` is the rows of a batch of the shortest prompts and wider batches take
    fewer (static_batches), each decoding with a pooled cache of its own width (StaticCachePool).

    `batch_log` gets one entry per batch run: engine, rows, padded width, cache width (None for
    "continuous", whose paged cache the library sizes), seconds and steps (tokens in the longest row: the
    forward passes of a padded batch, prefill included, fewer than max_new_tokens when every row stopped
    early).
    """

    def __init__(self, load_model: Callable[[str], Any], tokenizer, stop_ids: set[int], max_new_tokens: int,
                 temperature: float, batch_size: int, max_prompt_tokens: int, seed: int = 0,
                 devices: Sequence[str] = ("cpu",), engine: str = DEFAULT_ENGINE):
        engine = resolve_engine(engine, devices)
        if engine not in ENGINES:
            raise ValueError(f"unknown regeneration engine {engine!r}; one of {', '.join(ENGINES)}")
        self.engine = engine
        self._load_model = load_model
        self.devices = list(devices)
        self.models: list[Any] = []
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = 1.0  # nucleus sampling: --synthesize's user turns set it (eagle3_pipeline.data.turn_samplers)
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.hit_max_new_tokens = 0
        self.generated_tokens = 0  # up to each reply's stop token, for rates
        self.batch_log: list[dict] = []
        self.caches = StaticCachePool()
        self.full_rows: bool | None = None  # loop_rows: None fills a batch's rows where the step is compiled
        self.on_step: StepListener | None = None  # told each batch's decoding steps as they run (listen)
        # Any id works for padding (padded positions are masked out); left padding is done by hand.
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, min(stop_ids, default=0))
                           if i is not None)

    @property
    def uses_static_cache(self) -> bool:
        """"static" and "loop": batches packed by a token budget, each with a pooled StaticCache."""
        return self.engine in ("static", "loop")

    def _ensure_models(self) -> list[Any]:
        if not self.models:
            import torch

            get_logger().info("loading the verifier for regeneration on %s", ", ".join(self.devices))
            self.models = [self._load_model(device) for device in self.devices]
            torch.manual_seed(self.seed)
        return self.models

    def reseed(self, seed: int) -> None:
        """Load the verifier if not yet loaded, then seed torch's RNG: the sampling that follows repeats."""
        import torch

        self._ensure_models()
        torch.manual_seed(seed)

    def continue_tokens(self, prompts: list[list[int]]) -> list[list[int] | None]:
        """Generated token rows for prompts given as token ids (None for one not shorter than the length
        budget), batched as the responder batches conversations."""
        usable = sorted((i for i, p in enumerate(prompts) if 0 < len(p) < self.max_prompt_tokens),
                        key=lambda i: len(prompts[i]))
        chunks = [[usable[k] for k in batch] for batch in self._batches([len(prompts[i]) for i in usable])]
        rows: list[list[int] | None] = [None] * len(prompts)
        for chunk, out in zip(chunks, self._generate_all([[prompts[i] for i in chunk] for chunk in chunks])):
            for i, row in zip(chunk, out):
                rows[i] = row
        return rows

    def render(self, conversation: list[dict]) -> str | None:
        """The prompt text the verifier continues: the chat template with the assistant's turn opened."""
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - an unrenderable conversation gets no reply
            return None

    def __call__(self, conversations: list[list[dict]]) -> list[str | None]:
        encoded, chunks = self.plan(conversations)
        replies: list[str | None] = [None] * len(conversations)
        for chunk, rows in zip(chunks, self._generate_all([[encoded[i] for i in chunk] for chunk in chunks])):
            for i, row in zip(chunk, rows):
                replies[i] = self._decode(row)
        return replies

    def plan(self, conversations: list[list[dict]]) -> tuple[list[list[int] | None], list[list[int]]]:
        """The conversations' prompt tokens (None: not renderable) and the batches a call runs, as lists of
        indices into `conversations`: the prompts within the length budget, shortest first."""
        texts = [self.render(c) for c in conversations]
        renderable = [i for i, t in enumerate(texts) if t is not None]
        encoded: list[list[int] | None] = [None] * len(texts)
        if renderable:  # one call: a fast tokenizer encodes the batch on all cores
            ids = self.tokenizer([texts[i] for i in renderable], add_special_tokens=False)["input_ids"]
            for i, row in zip(renderable, ids):
                encoded[i] = list(row)
        usable = [i for i, ids in enumerate(encoded) if ids is not None and 0 < len(ids) < self.max_prompt_tokens]
        usable.sort(key=lambda i: len(encoded[i]))  # similar lengths together: less padding
        return encoded, [[usable[k] for k in batch] for batch in self._batches([len(encoded[i]) for i in usable])]

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices into `lengths` (sorted shortest first) of each batch: "static" and "loop" pack by their
        token budget, "generate" takes `batch_size` prompts, "continuous" one equal share per verifier copy."""
        if self.uses_static_cache:
            return static_batches(lengths, self.batch_size, self.max_new_tokens)
        size = self.batch_size if self.engine == "generate" else max(1, -(-len(lengths) // len(self.devices)))
        return [list(range(start, min(start + size, len(lengths)))) for start in range(0, len(lengths), size)]

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
        with sdpa_without_cudnn(), ThreadPoolExecutor(len(models), thread_name_prefix="regenerate") as pool:
            return list(pool.map(run, batches))

    def _config(self):
        from transformers import GenerationConfig

        sampling = self.temperature > 0
        return GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=sampling,
                                temperature=self.temperature if sampling else None,
                                top_p=self.top_p if sampling else None, top_k=0 if sampling else None,
                                eos_token_id=sorted(self.stop_ids), pad_token_id=self.pad_id)

    def batch_totals(self) -> dict:
        """The batches run so far (replies and --synthesize's user turns): how many, the seconds inside them and
        the tokens they generated (up to each stop id). A run's wall time beyond these seconds is its fixed
        costs: loading, reading, tokenizing, filtering, writing."""
        return {"batches": len(self.batch_log), "seconds": round(sum(b["seconds"] for b in self.batch_log), 2),
                "tokens": sum(b.get("tokens", 0) for b in self.batch_log)}

    def listen(self, on_step: StepListener | None) -> None:
        """Tell `on_step(token_steps, tokens)` how each batch's decoding advances (None: stop telling)."""
        self.on_step = on_step

    def _generate(self, model, prompts: list[list[int]]) -> list[list[int]]:
        """One batch's generated rows, timed into `batch_log`."""
        device = next(model.parameters()).device
        width, cache_width = self._widths(prompts)
        started = synchronized_clock(device)
        tally = StepTally(self.on_step, len(prompts), self.stop_ids)
        rows = self._run_batch(model, prompts, device, width, cache_width, tally)
        tally.finish(rows)
        self.batch_log.append({"engine": self.engine, "rows": len(prompts), "width": width,
                               "cache_width": cache_width, "seconds": synchronized_clock(device) - started,
                               "steps": max(len(row) for row in rows), "tokens": tally.tokens})
        return rows

    def _widths(self, prompts: list[list[int]]) -> tuple[int, int | None]:
        """The batch's padded prompt width and the positions its KV cache holds (None: the library's paged
        cache). "static" and "loop" pad to a multiple of STATIC_WIDTH_STEP so compiled decoding steps are
        reused."""
        longest = max(len(p) for p in prompts)
        if self.engine == "continuous":
            return longest, None
        width = static_width(longest) if self.uses_static_cache else longest
        return width, width + self.max_new_tokens

    def _run_batch(self, model, prompts: list[list[int]], device, width: int, cache_width: int | None,
                   tally: StepTally):
        import torch

        self._set_attention(model)
        on_gpu = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
        if self.engine == "continuous":
            # not under inference_mode: the library's own thread updates tensors made here (it turns off
            # gradients itself)
            with on_gpu, sdpa_without_cudnn():
                return self._generate_continuous(model, prompts, device)
        with on_gpu, torch.inference_mode(), sdpa_without_cudnn():
            if self.engine == "loop":
                return self._generate_loop(model, prompts, device, width, cache_width, tally)
            return self._generate_padded(model, prompts, device, width, cache_width, tally)

    def _set_attention(self, model) -> None:
        """"static" and "loop" decode with eagle3_pipeline.verifier.decode_attention (no K/V copies for grouped heads);
        the other engines with transformers' own SDPA (a model shared between engines is switched back)."""
        from eagle3_pipeline.verifier.decode_attention import NAME, use_gqa_decode_attention

        if self.uses_static_cache:
            use_gqa_decode_attention(model)
        elif getattr(model.config, "_attn_implementation", None) == NAME:
            model.set_attn_implementation("sdpa")

    def _generate_padded(self, model, prompts: list[list[int]], device, width: int,
                         cache_width: int, tally: StepTally) -> list[list[int]]:
        """One batch left-padded to `width` through `generate`: "static" with a pooled StaticCache of
        `cache_width` positions, "generate" with the dynamic cache generate makes. generate compiles its
        decoding step on a GPU for a cache it is given as for one it makes: its test
        (`_valid_auto_compile_criteria`) asks only for a compileable cache on a GPU."""
        input_ids, attention = self._left_padded(prompts, device, width)
        static = self.engine == "static"
        lent = self.caches.lend(model, device, len(prompts), cache_width) if static else nullcontext()
        with lent as cache:
            given = {generate_cache_keyword(): cache} if static else {}
            output = model.generate(input_ids=input_ids, attention_mask=attention,
                                    generation_config=self._config(), streamer=tally, **given)
        return output[:, width:].tolist()

    def _generate_loop(self, model, prompts: list[list[int]], device, width: int,
                       cache_width: int, tally: StepTally) -> list[list[int]]:
        """One batch left-padded to `width` through eagle3_pipeline.data.decode_loop, with a pooled StaticCache of
        `cache_width` positions."""
        from eagle3_pipeline.data.decode_loop import decode

        rows = self.loop_rows(len(prompts), width, device)
        filled = prompts + [prompts[0]] * (rows - len(prompts))
        input_ids, attention = self._left_padded(filled, device, width)
        with self.caches.lend(model, device, rows, cache_width) as cache:
            return decode(model, cache, input_ids, attention, cache_width, self.max_new_tokens, self.stop_ids,
                          self.pad_id, self.temperature, self.top_p, on_check=tally.at, live_rows=len(prompts))

    def loop_rows(self, prompts: int, width: int, device) -> int:
        """Rows the "loop" engine decodes a batch of `prompts` prompts padded to `width` with. Where its step is
        compiled (a GPU), every batch of a width gets that width's full row count (static_rows), filler rows
        after the prompts: a call's last, short batch would otherwise be a shape of its own, compiled again in
        every call (every round, split and --synthesize turn) until dynamo's recompile limit turns the step
        eager. `full_rows` (None: on a GPU) says whether to fill."""
        fill = device.type == "cuda" if self.full_rows is None else self.full_rows
        return max(prompts, static_rows(width, self.batch_size, self.max_new_tokens)) if fill else prompts

    def _left_padded(self, prompts: list[list[int]], device, width: int):
        """The prompts left-padded to `width` with the pad id, and their attention mask (0 on pads)."""
        import torch

        pad = self.pad_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return input_ids, attention

    def _generate_continuous(self, model, prompts: list[list[int]], device) -> list[list[int]]:
        """All prompts through transformers' continuous batching; rows in the prompts' order."""
        outputs = model.generate_batch(prompts, generation_config=self._config(),
                                       continuous_batching_config=continuous_batching_config(device, self.seed),
                                       progress_bar=False)
        rows = list(outputs.values())
        failed = [o for o in rows if getattr(o, "error", None) is not None]
        if len(rows) != len(prompts) or failed:
            detail = failed[0].error if failed else f"{len(rows)} results for {len(prompts)} prompts"
            raise RuntimeError(f"continuous batching did not finish every request ({detail}); rerun with "
                               "--regenerate-engine generate to use plain generate")
        # the library counts EOS among the generated tokens; _decode cuts at the first stop id anyway
        return [list(o.generated_tokens) for o in rows]

    def _decode(self, row: list[int]) -> str:
        stop = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
        if stop is None:
            self.hit_max_new_tokens += 1
        self.generated_tokens += len(row) if stop is None else stop + 1
        return self.tokenizer.decode(row[:stop], skip_special_tokens=True).strip()


def continuous_batching_config(device, seed: int):
    """The paged cache's settings: sized by the library from free memory on a GPU; small and without CUDA
    graphs on the CPU, where its memory-based sizing takes seconds and graphs do not exist. Written for
    transformers 5.17 (block_size) and later (page_size)."""
    import dataclasses

    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    options: dict[str, Any] = {"seed": seed} if "seed" in fields else {}
    if device.type != "cuda":
        options.update(num_blocks=64, max_batch_tokens=1024, use_cuda_graph=False)
        options["page_size" if "page_size" in fields else "block_size"] = 64
    return ContinuousBatchingConfig(**options)


# --- the OpenAI-compatible endpoint responder ---------------------------------------------------------

def endpoint_base(url: str) -> str:
    """The server root: "http://host:port", "http://host:port/" and "http://host:port/v1" are the same."""
    base = url.strip().rstrip("/")
    return base[:-len("/v1")] if base.endswith("/v1") else base


def _is_transient(err: Exception) -> bool:
    """Worth retrying: the server is busy or restarting (5xx, 429) or the connection broke."""
    if isinstance(err, urllib.error.HTTPError):
        return err.code >= 500 or err.code == 429
    return isinstance(err, (urllib.error.URLError, ConnectionError, TimeoutError))


class RequestFailed(Exception):
    """A request that failed for good: `error` is the last failure, after `attempts` tries."""

    def __init__(self, error: Exception, attempts: int):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.attempts = error, attempts


def post_json(url: str, payload: dict, timeout_s: float, read, retries: int, backoff_s: float):
    """POST `payload` as JSON and return read(the JSON answer); a transient failure is retried with exponential
    backoff, any other failure (read's included) or the last try's raises RequestFailed."""
    body = json.dumps(payload).encode("utf-8")
    for attempt in range(retries + 1):
        try:
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return read(json.loads(response.read()))
        except Exception as err:  # noqa: BLE001 - every failure is either retried or raised as RequestFailed
            if _is_transient(err) and attempt < retries:
                time.sleep(backoff_s * 2 ** attempt)
                continue
            raise RequestFailed(err, attempt + 1) from err
    raise AssertionError("not reached: the last attempt returns or raises")


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

    def _respond(self, messages: list[dict]) -> str | None:
        def choice_of(answer: dict) -> tuple[dict, str]:
            choice = answer["choices"][0]
            return choice, choice["message"]["content"]

        payload = {"model": self.model, "messages": messages, "max_tokens": self.max_new_tokens,
                   "temperature": self.temperature}
        try:
            choice, reply = post_json(self.url, payload, self.timeout_s, choice_of, self.retries, self.backoff_s)
        except RequestFailed as failed:
            self._record_failure(failed.error, failed.attempts)
            return None
        if choice.get("finish_reason") == "length":
            with self._lock:
                self.hit_max_new_tokens += 1
        return (reply or "").strip()

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
