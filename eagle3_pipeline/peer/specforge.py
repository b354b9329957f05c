"""SpecForge 0.2.0's offline EAGLE-3 training recipe, run from its own wheel on our stage-02 hidden states.

Nothing of the recipe is re-implemented here: the drafter is SpecForge's LlamaForCausalLMEagle3 built by
AutoDraftModel.from_config, the vocabulary map goes through its load_vocab_mapping, each sample through its
offline normaliser (eagle3 normalize_offline_sample), the teacher through its TargetHead, the TTT unroll and
KL loss through OnlineEagle3Model, the step through TrainerCore.train_step over Eagle3TrainStrategy
(ploss 0.8**i) and FSDPTrainingBackend, the optimizer is its BF16Optimizer (fp32-master AdamW, clipping,
warmup + cosine), and the horizon its resolve_total_steps. This module only feeds those pieces our files
and records what they report. docs/training.md ("Side by side with SpecForge") says what is compared.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3_pipeline.errors import UsageError

SPECFORGE_VERSION = "0.2.0"
INSTALL_HINT = (f"pip install --no-deps specforge=={SPECFORGE_VERSION} (offline: pip install --no-deps --target DIR "
                f"specforge-{SPECFORGE_VERSION}-py3-none-any.whl, then PYTHONPATH=DIR)")

# SpecForge 0.2.0's own defaults (specforge/config/schema.py: TrainingConfig, ModelConfig, DataConfig;
# Eagle3TrainStrategy's ploss_decay), used for every setting our stage-04 run does not fix.
SPECFORGE_DEFAULTS = {"epochs": 1, "lr": 1e-4, "seed": 42, "max_length": 2048, "ttt_steps": 7,
                      "warmup_ratio": 0.015, "max_grad_norm": 0.5, "lr_scheduler": "cosine", "ploss_decay": 0.8,
                      "batch_size": 1, "accumulation_steps": 1, "dtype": "bfloat16",
                      "attention_backend": "flex_attention"}


@dataclass
class RecipeSettings:
    epochs: int
    lr: float
    seed: int
    max_length: int
    ttt_steps: int
    warmup_ratio: float = SPECFORGE_DEFAULTS["warmup_ratio"]
    max_grad_norm: float = SPECFORGE_DEFAULTS["max_grad_norm"]
    lr_scheduler: str = SPECFORGE_DEFAULTS["lr_scheduler"]
    dtype: str = SPECFORGE_DEFAULTS["dtype"]
    attention_backend: str = SPECFORGE_DEFAULTS["attention_backend"]
    wrap: bool = True  # FSDP-wrap the model, as `specforge train` does even on one GPU

    def as_dict(self) -> dict:
        return asdict(self)


def specforge_importable() -> bool:
    try:
        import specforge  # noqa: F401  (its __init__ is light: no torch work)
    except ImportError:
        return False
    return True


def import_specforge(device_type: str) -> types.SimpleNamespace:
    """The SpecForge pieces of the recipe. On a CPU without triton, SpecForge's Triton KL loss cannot run
    (and its module cannot even be imported): the loss is then SpecForge's own reference implementation of the
    same KL (specforge.core.loss._compute_loss), reported in `cpu_substitutions`."""
    if not specforge_importable():
        raise UsageError(f"SpecForge is not installed: {INSTALL_HINT}")
    substitutions: list[str] = []
    if device_type == "cpu" and not _triton_importable():
        _import_loss_module_without_triton()
        substitutions.append("placeholder `triton` module while importing specforge.core.loss")
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.algorithms.eagle3.providers import build_step
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.schedule import resolve_total_steps
    from specforge.training.strategies.base import StepContext

    if device_type == "cpu":
        from specforge.core.loss import _compute_loss

        class ReferenceKLLoss:  # LogSoftmaxLoss.apply's signature and value, in plain torch
            apply = staticmethod(_compute_loss)

        eagle3_model.LogSoftmaxLoss = ReferenceKLLoss
        substitutions.append("KL loss: specforge.core.loss._compute_loss (SpecForge's torch reference of its "
                             "Triton LogSoftmaxLoss)")
    return types.SimpleNamespace(
        normalize_offline_sample=normalize_offline_sample, build_step=build_step,
        validate_vocab_mapping_consistency=validate_vocab_mapping_consistency,
        AutoDraftModel=AutoDraftModel, AutoDraftModelConfig=AutoDraftModelConfig, TargetHead=TargetHead,
        BF16Optimizer=BF16Optimizer, TrainBatch=TrainBatch, FSDPTrainingBackend=FSDPTrainingBackend,
        ParallelConfig=ParallelConfig, TrainerCore=TrainerCore, resolve_total_steps=resolve_total_steps,
        StepContext=StepContext, OnlineEagle3Model=eagle3_model.OnlineEagle3Model,
        cpu_substitutions=substitutions)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def _import_loss_module_without_triton() -> None:
    """Import specforge.core.loss with a stand-in `triton` that only lets its kernel definitions parse;
    the stand-in leaves sys.modules right after, so torch never mistakes it for real triton."""
    torch.compile(lambda x: x)  # torch probes for triton while building its compile stack: let it find none first
    stub = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = int
    stub.language = language
    stub.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    stub.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()
    sys.modules["triton"], sys.modules["triton.language"] = stub, language
    try:
        import specforge.core.loss  # noqa: F401  (cached in sys.modules with its kernels parsed)
    finally:
        sys.modules.pop("triton", None)
        sys.modules.pop("triton.language", None)


def init_one_rank_group() -> None:
    """A one-process group, as `specforge train` sets up for a direct single-GPU run (FSDP needs one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("FSDP_SHARDING", "SHARD_GRAD_OP")  # specforge train's training.fsdp_sharding default
    from specforge.distributed import init_distributed

    init_distributed(timeout=10, tp_size=1, sp_ulysses_size=1, sp_ring_size=1)


class SpecForgeRecipe:
    """SpecForge's drafter, teacher head, optimizer and trainer step, set up as its offline single-GPU run."""

    def __init__(self, sf: types.SimpleNamespace, drafter_config: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                 d2t: torch.Tensor, t2d: torch.Tensor, settings: RecipeSettings, total_steps: int, device: str):
        self.sf, self.settings, self.total_steps = sf, settings, total_steps
        self.device = torch.device(device)
        self.dtype = getattr(torch, settings.dtype)
        self.global_step = 0
        with tempfile.TemporaryDirectory(prefix="specforge_recipe_") as tmp:
            self.draft_model = self._build_drafter(Path(tmp), drafter_config, embed, d2t, t2d)
            self.target_head = self._build_target_head(Path(tmp), lm_head)
        model = sf.OnlineEagle3Model(draft_model=self.draft_model, length=settings.ttt_steps,
                                     attention_backend=settings.attention_backend)
        model = model.to(device=self.device, dtype=self.dtype)
        if settings.wrap:
            init_one_rank_group()
        parallel = sf.ParallelConfig.from_distributed(tp_size=1, sp_ulysses_size=1, sp_ring_size=1)
        self.backend = sf.FSDPTrainingBackend(parallel, optimizer_factory=lambda module: sf.BF16Optimizer(
            module, lr=settings.lr, max_grad_norm=settings.max_grad_norm, total_steps=total_steps,
            warmup_ratio=settings.warmup_ratio, lr_scheduler=settings.lr_scheduler))
        wrapped = self.backend.prepare_model(model, wrap=settings.wrap, optimizer_target=model.draft_model)
        self.core = sf.TrainerCore(sf.build_step(wrapped, target_head=self.target_head), self.backend,
                                   accumulation_steps=1)

    def _build_drafter(self, tmp: Path, drafter_config: dict, embed, d2t, t2d):
        """AutoDraftModelConfig.from_file + AutoDraftModel.from_config (SpecForge's random init), the verifier's
        embedding copied in and frozen, the vocabulary map through load_vocab_mapping."""
        sf = self.sf
        (tmp / "draft_config.json").write_text(json.dumps(drafter_config))
        config = sf.AutoDraftModelConfig.from_file(str(tmp / "draft_config.json"))
        draft = sf.AutoDraftModel.from_config(config, attention_backend=self.settings.attention_backend,
                                              torch_dtype=self.dtype)
        torch.save({"d2t": d2t.to(torch.int64), "t2d": t2d.to(torch.bool)}, tmp / "vocab_mapping.pt")
        draft.load_vocab_mapping(str(tmp / "vocab_mapping.pt"))
        with torch.no_grad():  # what draft.load_embedding does, from the tensor we already read
            draft.embed_tokens.weight.copy_(embed.to(draft.embed_tokens.weight.dtype))
        draft.freeze_embedding()
        draft = draft.to(device=self.device, dtype=self.dtype)
        sf.validate_vocab_mapping_consistency(draft.t2d, draft.d2t)
        return draft

    def _build_target_head(self, tmp: Path, lm_head: torch.Tensor):
        """TargetHead as TargetHead.from_pretrained leaves it (frozen, eval, bf16). Its config only needs the
        two sizes; writing them ourselves also serves verifiers whose folder it cannot read (GGUF, nested)."""
        from transformers import LlamaConfig

        vocab, hidden = lm_head.shape
        LlamaConfig(hidden_size=hidden, vocab_size=vocab, num_attention_heads=1, num_key_value_heads=1,
                    num_hidden_layers=1, intermediate_size=1).save_pretrained(tmp / "target")
        head = self.sf.TargetHead(str(tmp / "target"))
        with torch.no_grad():
            head.fc.weight.copy_(lm_head.to(head.fc.weight.dtype))
        head.freeze_weights()
        return head.eval().to(device=self.device, dtype=torch.bfloat16)

    def batch_maker(self) -> "BatchMaker":
        return BatchMaker(self.sf.normalize_offline_sample, self.sf.TrainBatch, self.settings.max_length,
                          self.dtype, self.target_head.fc.weight.dtype)

    def train_step(self, batch) -> dict:
        """One optimizer step (TrainerCore.train_step); its reduced metrics: acc_j, ploss_j, loss, ..."""
        result = self.core.train_step(batch, self.sf.StepContext(global_step=self.global_step,
                                                                 total_steps=self.total_steps))
        self.global_step += 1
        metrics = {key: float(value) for key, value in result.metrics.items() if isinstance(value, (int, float))}
        if result.grad_norm is not None:
            metrics["grad_norm"] = float(result.grad_norm)
        metrics["lr"] = float(self.backend.optimizer.get_learning_rate())
        return metrics

    def close(self) -> None:
        """End the one-rank process group this recipe started (if it did)."""
        import torch.distributed as dist

        if self.settings.wrap and dist.is_initialized():
            from specforge.distributed import destroy_distributed

            destroy_distributed()

    def trained_state(self) -> dict:
        """The drafter's tensors as SpecForge checkpoints them: the backend's full state dict (gathered from FSDP),
        through the strategy's checkpoint filter ("draft_model." prefix removed, the frozen embedding left out)."""
        return self.core.strategy.checkpoint_state_filter(self.backend.state_dict()["model"])


@dataclass
class BatchMaker:
    """One stage-02 sample (load_sample's aux/final/input_ids/loss_mask) through SpecForge's offline normaliser
    (cut to max_length, last loss position cleared) into its TrainBatch. Holds no model, so loader workers
    can run it. SpecForge's collator (DataCollatorWithPadding) is the identity for one sequence, and its module
    imports `datasets`, which the GPU machine lacks: it is left out."""
    normalize: object
    train_batch: type
    max_length: int
    hidden_dtype: torch.dtype
    target_dtype: torch.dtype

    def __call__(self, sample_id: str, sample: dict):
        raw = {"aux_hidden_state": sample["aux"][None], "hidden_state": sample["final"][None],
               "input_ids": sample["input_ids"].to(torch.long), "loss_mask": sample["loss_mask"].to(torch.long)}
        tensors = self.normalize(raw, max_len=self.max_length)
        tensors["hidden_state"] = tensors["hidden_state"].to(self.hidden_dtype)
        tensors["target"] = tensors["target"].to(self.target_dtype)
        return self.train_batch(sample_ids=[sample_id], strategy="eagle3", tensors=tensors,
                                metadata={"target_repr": "hidden_state"})
