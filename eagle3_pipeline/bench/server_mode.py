"""--mode server: the prompts sent to a running server (and a baseline server), and the run's summary line."""
from __future__ import annotations

import time

from eagle3_pipeline.figures import fmt
from eagle3_pipeline.bench.settings import STAGE, BenchConfig, recorded_settings
from eagle3_pipeline.errors import require


def run_server(config: BenchConfig, log, begin, prompt_spec, prompts, overlap) -> dict:
    """Send the prompts to --url (and --baseline-url); the results of --mode server."""
    from eagle3_pipeline.bench.server import check_reachable, run_server_benchmark

    server, verifier, decoding = config.server, config.verifier, config.decoding
    require(server, "url")
    render = None
    if server.server_api in ("generate", "completions"):  # token ids rendered here, as offline mode renders them
        require(verifier, "model_path")
        from eagle3_pipeline.bench.prompts import has_chat_template, render_conversation
        from eagle3_pipeline.verifier.loading import load_tokenizer

        tokenizer = load_tokenizer(verifier.model_path, verifier.trust_remote_code, verifier.chat_template)
        raw = not has_chat_template(tokenizer)
        render = lambda messages: render_conversation(tokenizer, messages, raw)  # noqa: E731
    check_reachable(server.url, "--url")
    if server.baseline_url:
        check_reachable(server.baseline_url, "--baseline-url")
    begin()
    common = dict(api=server.server_api, max_new_tokens=decoding.max_new_tokens, temperature=decoding.temperature,
                  top_p=decoding.top_p, concurrency=server.concurrency, render=render, log=log)
    log.info("sending %d prompts to %s (%s API, concurrency %d)", len(prompts), server.url, server.server_api,
             server.concurrency)
    speculative = run_server_benchmark(server.url, prompts, flag="--url", **common)
    baseline = None
    if server.baseline_url:
        log.info("sending the same prompts to the baseline %s", server.baseline_url)
        baseline = run_server_benchmark(server.baseline_url, prompts, flag="--baseline-url", **common)
    speedup = None
    if baseline and baseline["output_tokens_per_s"] and speculative["output_tokens_per_s"]:
        speedup = speculative["output_tokens_per_s"] / baseline["output_tokens_per_s"]
    return {"mode": "server", "stage": STAGE, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": recorded_settings(config, {"prompts": prompt_spec, "prompt_count": len(prompts)}),
            "overlap_check": overlap, "speculative": speculative, "baseline": baseline, "speedup": speedup}


def server_summary_line(results: dict) -> str:
    """The one-line SUMMARY of --mode server: accept length, tokens/s, latency, speedup."""
    spec = results["speculative"]
    line = (f"accept length {fmt(spec['accept_length'])} ({spec['accept_length_source'] or 'not reported'}) | "
            f"output {fmt(spec['output_tokens_per_s'], 1)} tok/s | latency p50/p90/p99 "
            f"{fmt(spec['latency_s']['p50'], 2)}/{fmt(spec['latency_s']['p90'], 2)}/{fmt(spec['latency_s']['p99'], 2)} s")
    if results.get("baseline"):
        line += (f" | baseline {fmt(results['baseline']['output_tokens_per_s'], 1)} tok/s, speedup "
                 f"{fmt(results['speedup'], 2)}x")
    if spec.get("vllm_acceptance"):
        line += " | " + vllm_summary(spec["vllm_acceptance"])
    elif spec.get("sglang_acceptance"):
        line += " | " + sglang_summary(spec["sglang_acceptance"])
    return line


def vllm_summary(vllm: dict) -> str:
    """The SUMMARY's part for vLLM's own counters (vllm_metrics.vllm_acceptance)."""
    rates = ", ".join(fmt(rate, 2) for rate in vllm["acceptance_rate_by_position"] or [])
    return (f"vLLM: mean acceptance length {fmt(vllm['mean_acceptance_length'])}, draft acceptance rate "
            f"{fmt(vllm['draft_acceptance_rate'])}, by position [{rates}] over {vllm['drafts']} verify steps")


def sglang_summary(sglang: dict) -> str:
    """The SUMMARY's part for the server's own acceptance fields (server.sglang_acceptance): the figures the
    replies carried, then the fields none carried."""
    if not any(sglang["requests"].values()):  # no reply carried any of the fields
        return "SGLang acceptance fields: none in the replies"
    figures = [("completion/verify", sglang["completion_tokens_per_verify_ct"]),
               ("mean spec_accept_length", sglang["mean_spec_accept_length"]),
               ("spec_accept_rate", sglang["spec_accept_rate"]), ("histogram tau", sglang["histogram_tau"])]
    parts = [f"{name} {fmt(value)}" for name, value in figures if value is not None]
    if sglang["acceptance"]:
        rates = ", ".join(fmt(rate, 2) for rate in sglang["acceptance"]["conditional_rate"])
        parts.append(f"acceptance by position [{rates}]")
    line = "SGLang: " + ", ".join(parts)
    if sglang["absent"]:
        line += f" (absent: {', '.join(sglang['absent'])})"
    return line
