"""What every column of stage 05's reports means, in one place: each report ends with a '## Columns' section
that explains each column of its tables once, in the order they first appear."""
from __future__ import annotations

from eagle3_pipeline.figures import TTT_ESTIMATE, WALKED_CHAIN_TAU

MEANINGS = {
    # the settings table
    "flag": "a flag of 05_benchmark.py that decides what was measured (`--help` says what each does)",
    "value": "what this run used: the flag as given, taken from the run directory or its default "
             "(- for none), or the figure as measured",
    # offline mode
    "tau": "tokens per verify step: the accepted draft tokens plus the verifier's own one, pooled (all tokens / "
           "all verify steps); 1 means no draft was accepted, and with k drafts a step the most is k + 1",
    "tok/s speculative": "new tokens per second of speculative decoding (the drafter drafts, the verifier checks)",
    "tok/s same loop, no drafter": "new tokens per second of the same decoding loop without the drafter (one "
                                   "verifier forward per token, with the KV cache)",
    "tok/s HF generate": "new tokens per second of transformers' `generate` on the same prompts",
    "speedup vs loop": "tok/s speculative over tok/s of the same loop without the drafter, pooled over the "
                       "turns; above 1 the drafter pays; (noisy): too few turns or tokens to quote",
    "speedup vs HF generate": "tok/s speculative over tok/s HF generate",
    "4-gram repetition": "share of the output tokens that lie inside a 4-gram (4 tokens in a row) which already "
                         "occurred earlier in the same turn's output (0 to 1); loops are easy to draft, so a high "
                         "share says a high tau comes from repetition rather than from the drafter",
    "turns": "turns decoded; every turn of a prompt counts, later turns continue the conversation on the "
             "verifier's own replies",
    "prompt": "the prompt's id in the prompt file",
    "turn": "the turn within its prompt, counted from 0",
    "first divergence": "the output token (from 0) where the speculative output first differs from the reference",
    "share before": "the share of the output before the first divergence",
    "logit margin": "the verifier's logit of its own greedy token minus that of the speculative output's token "
                    "at the divergence, that position's logits computed alone; near 0 is a tie from "
                    "low-precision numerics, a large margin points at a bug",
    "tie": "yes when the margin is not positive: the verifier's own argmax there flips with how its logits "
           "are computed",
    "output tokens": "the output positions (tokens into the turn's reply) where the window's verify steps begin",
    "verify steps": "verifier forward passes that checked drafts",
    "position": "the draft token's place in a verify step (1: the first draft)",
    "conditional rate": "of the verify steps that accepted every earlier position, the share that accepted this "
                        "one (-: never reached)",
    "share of verify steps": "of all verify steps, the share that accepted this position",
    "category": "the prompt's category in the prompt file ((none) when it has none)",
    "prompts": "prompts chosen from this category",
    "new tokens": "tokens the speculative decoding produced over the prompt's turns",
    # server mode
    "server": "speculative: the server at --url; baseline: the one at --baseline-url (no drafter)",
    "url": "where the requests went",
    "requests": "requests answered, one per turn",
    "completion tokens": "tokens the server generated over all requests (its completion_tokens)",
    "output tok/s": "completion tokens over the wall time of all requests, --concurrency at a time",
    "accept length": "the server's tau: its completion_tokens over its spec_verify_ct, summed over the requests "
                     "(or the source named below)",
    "latency p50 s": "the median request's wall time, seconds",
    "latency p90 s": "the 90th percentile of the requests' wall time, seconds",
    "latency p99 s": "the 99th percentile of the requests' wall time, seconds",
    "figure": "one of SGLang's acceptance figures, with how it is computed from the replies' meta_info",
    "requests with it": "requests whose meta_info carried what the figure needs",
    "accepted drafts in a verify step": "a bucket of SGLang's histogram: verify steps that accepted exactly this "
                                        "many drafts",
    "share with this many": "the share of all verify steps that accepted exactly this many drafts",
    # eval mode
    WALKED_CHAIN_TAU: "greedy chain decoding with 3 drafts a verify step, walked over the teacher-forced "
                      "predictions of each reply's first --max-new-tokens tokens: the figure to compare with "
                      "--mode offline's tau",
    TTT_ESTIMATE: "1 + sum over k of the product of the top-1 agreement of TTT steps 0..k: each TTT step taken "
                  "for a draft, independent of the others; it overstates what decoding accepts (stage 04 "
                  "picks `best` by it)",
    "loss": "the drafter's cross-entropy against the verifier's next-token distribution, weighted 0.8^j over "
            "the TTT steps j",
    "tokens": "reply tokens scored",
    "TTT step": "0: the token after the verifier's; j: the token j further, drafted from the drafter's own "
                "earlier drafts",
    "top-1 agreement": "the share of tokens where the drafter's most likely token is the verifier's",
    "loss at this step": "the cross-entropy at this TTT step alone",
}

INDEX_MEANINGS = {  # the folder's README.md, which lists every report
    "when (UTC)": "when the run finished",
    "mode": "offline (decoding here), server (a running server) or eval (teacher-forced, no decoding)",
    "report": "the report's Markdown; the .json beside it holds every number",
    "drafter": "the drafter checkpoint's folder name",
    "prompts (count)": "the prompt file and how many of its prompts ran",
    "setting": "k=N: N draft tokens a verify step (--num-steps), topk=N: N branches a draft step (a tree), "
               "T: the temperature (0: greedy); concurrency: requests at a time (server); TTT N: TTT steps "
               "scored (eval)",
    "tau": f"tokens per verify step (offline); the server's accept length (server); the {WALKED_CHAIN_TAU} "
           f"(eval)",
    "speedup": "tok/s against the same loop without the drafter (offline) or the baseline server (server); "
               "(noisy): too few turns or tokens to quote; tau only: no timing run (--tau-only)",
    "dtype": "the dtype the models computed in",
}


def table_columns(markdown: str) -> list[str]:
    """The columns of every table in a Markdown text, each once, in the order they first appear."""
    names: list[str] = []
    lines = markdown.splitlines()
    for line, below in zip(lines, lines[1:]):
        if below.startswith("|---"):
            names += [cell for cell in (c.strip() for c in line.strip().strip("|").split("|")) if cell not in names]
    return names


def columns_section(markdown: str, meanings: dict[str, str] = MEANINGS) -> str:
    """'## Columns': one line for each column of the text's tables."""
    lines = [f"- **{name}**: {meanings.get(name, 'see docs/benchmarking.md')}" for name in table_columns(markdown)]
    return "\n".join(["", "## Columns", "", *lines]) + "\n"
