"""Stage 01's settings, typed: built once from the parsed flags, the one place the library reads them.

Each dataclass holds one concept. None has defaults of its own: every value comes from the parsed command line,
whose defaults are the flag table's (eagle3_pipeline/cli/flags.py). Below the stage script, the library takes these,
never the Namespace. A switch (store_true) not given parses as None: here it is False.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle3_pipeline.errors import require
from eagle3_pipeline.formats.manifest import resolved_config


@dataclass(frozen=True)
class VerifierSettings:
    """What the verifier is and how it is loaded: its tokenizer always, its weights for in-process regeneration."""
    model_path: str
    trust_remote_code: bool
    chat_template: str | None  # a Jinja file replacing the tokenizer's own template
    device: str
    device_map: str
    dtype: str

    @classmethod
    def from_args(cls, args) -> VerifierSettings:
        return cls(model_path=args.model_path, trust_remote_code=bool(args.trust_remote_code),
                   chat_template=args.chat_template, device=args.device, device_map=args.device_map,
                   dtype=args.dtype)


@dataclass(frozen=True)
class DataSelection:
    """What is read and what of it is kept: the sources, the limits, the split, the share of bad records allowed."""
    datasets: tuple[str, ...]  # --dataset values as given
    exclude_prompts: tuple[str, ...]  # prompt files none of whose prompts is trained on
    source_counts: tuple[str, ...]  # --source-count SOURCE=N as given (inputs.source_counts parses them)
    max_seq_len: int
    max_turns: int | None  # None: every user turn
    num_samples: int | None  # None: every usable conversation
    eval_ratio: float
    max_bad_fraction: float

    @classmethod
    def from_args(cls, args) -> DataSelection:
        return cls(datasets=tuple(args.dataset or ()), exclude_prompts=tuple(args.exclude_prompts or ()),
                   source_counts=tuple(args.source_count or ()), max_seq_len=args.max_seq_len,
                   max_turns=args.max_turns, num_samples=args.num_samples, eval_ratio=args.eval_ratio,
                   max_bad_fraction=args.max_bad_fraction)


@dataclass(frozen=True)
class Regeneration:
    """--regenerate: whether the replies are the verifier's own, and how they are generated."""
    enabled: bool
    endpoint: str | None  # --regenerate-endpoint; None: the verifier in-process
    engine: str  # --regenerate-engine, in-process only
    max_new_tokens: int
    temperature: float
    batch_size: int | None  # None: the stage's default, which depends on the endpoint's concurrency
    concurrency: int  # requests in flight at once, endpoint only
    replies_per_prompt: int
    greedy_first_reply: bool

    @classmethod
    def from_args(cls, args) -> Regeneration:
        return cls(enabled=bool(args.regenerate), endpoint=args.regenerate_endpoint, engine=args.regenerate_engine,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.batch_size,
                   concurrency=args.concurrency, replies_per_prompt=args.replies_per_prompt,
                   greedy_first_reply=bool(args.greedy_first_reply))


@dataclass(frozen=True)
class Synthesis:
    """--synthesize N: how many conversations the verifier writes, and how their user turns are sampled."""
    count: int | None  # None: nothing is made
    turns: int
    temperature: float
    top_p: float
    max_tokens: int
    near_duplicate_threshold: float

    @classmethod
    def from_args(cls, args) -> Synthesis:
        return cls(count=args.synthesize, turns=args.synthesize_turns, temperature=args.synthesize_temperature,
                   top_p=args.synthesize_top_p, max_tokens=args.synthesize_max_tokens,
                   near_duplicate_threshold=args.near_duplicate_threshold)

    def as_flags(self) -> dict:
        """The settings under their flags' names, in the order the fingerprint has always recorded them."""
        return {"synthesize": self.count, "synthesize_turns": self.turns,
                "synthesize_temperature": self.temperature, "synthesize_top_p": self.top_p,
                "synthesize_max_tokens": self.max_tokens, "near_duplicate_threshold": self.near_duplicate_threshold}


@dataclass(frozen=True)
class Outputs:
    """Where the outputs go, and whether an earlier output there is replaced."""
    output_dir: str
    eval_output: str | None  # None: next to the training data
    overwrite: bool

    @classmethod
    def from_args(cls, args) -> Outputs:
        return cls(output_dir=args.output_dir, eval_output=args.eval_output, overwrite=bool(args.overwrite))


@dataclass(frozen=True)
class PrepareConfig:
    """Everything stage 01 was asked to do, and the command line as resolved (recorded in the manifest)."""
    verifier: VerifierSettings
    data: DataSelection
    regeneration: Regeneration
    synthesis: Synthesis
    outputs: Outputs
    seed: int  # the shuffle, the eval split, the per-source samples, sampled replies and made user turns
    flags: dict

    @classmethod
    def from_args(cls, args) -> PrepareConfig:
        """The typed settings; stops with a usage error naming the required flags left unset (a config without
        a verifier, or without data to read, has nothing to describe)."""
        require(args, "model_path", *(() if args.synthesize else ("dataset",)))
        return cls(verifier=VerifierSettings.from_args(args), data=DataSelection.from_args(args),
                   regeneration=Regeneration.from_args(args), synthesis=Synthesis.from_args(args),
                   outputs=Outputs.from_args(args), seed=args.seed, flags=resolved_config(args))
