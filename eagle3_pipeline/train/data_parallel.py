"""Stage 04 on several ranks: DDP (the default) or FSDP2 (`--fsdp`), behind one small interface for the Trainer
(the interface and how gradients are scaled: docs/training.md)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from eagle3_pipeline.distributed import RankInfo, all_reduce_sums


class TTTLossModule(nn.Module):
    """The drafter's training-time-test loss as a forward (what DDP and FSDP wrap)."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict, verifier_lm_head: torch.Tensor, ttt_steps: int, decay: float,
                noise_std: float, objective: str = "kl"):
        from eagle3_pipeline.train.loss import ttt_loss

        loss, metrics = ttt_loss(self.drafter, batch, verifier_lm_head, ttt_steps, decay=decay, noise_std=noise_std,
                                 objective=objective)
        if batch["input_ids"].shape[1] <= 2 and torch.is_grad_enabled():
            # No position of so short a batch has a label, so norm and lm_head took no part; DDP and FSDP
            # expect a gradient (here zero) for every trainable parameter.
            loss = loss + sum(p.reshape(-1)[:1].sum() * 0.0 for p in self.drafter.parameters() if p.requires_grad)
        return loss, metrics


class _Parameters:
    """What eagle3_pipeline.model.drafter.make_optimizer reads of a model: its parameters."""

    def __init__(self, params: list[nn.Parameter]):
        self._params = params

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._params)


class DataParallel:
    """DDP: every rank holds the whole drafter and optimizer; backward averages the gradients."""

    kind = "ddp"

    def __init__(self, info: RankInfo, device: str):
        self.info = info
        self.world_size = info.world_size
        self.device = torch.device(device)
        self.drafter: nn.Module | None = None
        self.module: nn.Module | None = None

    def wrap(self, drafter: nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.drafter = drafter
        module = TTTLossModule(drafter)
        # Not broadcast by DDP: the frozen embedding (maybe in CPU memory) and the buffers (d2t, t2d, RoPE),
        # identical on every rank by construction.
        ignored = ["drafter.embed_tokens.weight"] + [f"drafter.{name}" for name, _ in drafter.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
        self.module = DistributedDataParallel(
            module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        from eagle3_pipeline.train.optimizer import make_optimizer

        return make_optimizer(self.drafter, lr)

    def no_sync(self):
        return self.module.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.trainable(), max_norm)

    def zero_grad(self) -> None:
        pass  # the optimizer's zero_grad covers the drafter's own gradients

    def full_parameters(self):
        return nullcontext()

    def export_model(self) -> nn.Module | None:
        return self.drafter if self.info.is_main else None

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        from eagle3_pipeline.train.checkpoints import load_optimizer_state

        load_optimizer_state(optimizer, saved)

    def load_weights(self, folder: Path) -> None:
        from eagle3_pipeline.train.checkpoints import load_weights_exactly

        load_weights_exactly(self.drafter, folder)

    def reduce_sums(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return all_reduce_sums(sums)


class ShardedDataParallel(DataParallel):
    """FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer state sharded on dim 0."""

    kind = "fsdp"

    def wrap(self, drafter: nn.Module) -> None:
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
        except ImportError as err:
            raise RuntimeError(f"--fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6): {err}")
        import torch.distributed as dist

        self.drafter = drafter
        # Every rank shards from its own copy: make them rank 0's (they are equal when seeded alike).
        with torch.no_grad():
            for tensor in [p for p in drafter.parameters() if p.requires_grad] + list(drafter.buffers()):
                dist.broadcast(tensor, src=0)
        module = TTTLossModule(drafter)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        embedding = drafter.embed_tokens.weight
        try:
            fully_shard(module, mesh=self.mesh, ignored_params={embedding})
        except TypeError as err:  # a torch whose fully_shard has no ignored_params: shard the frozen rows too
            if "ignored_params" not in str(err) or embedding.device.type != self.device.type:
                raise
            fully_shard(module, mesh=self.mesh)
        self.module = module
        self.sharded = [p for p in drafter.parameters() if p.requires_grad]  # DTensors, in the usual order
        with torch.no_grad():
            # Plain-tensor views of this rank's shards (same storage): what the optimizer updates.
            self.local = [nn.Parameter(p.to_local(), requires_grad=True) for p in self.sharded]

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        from eagle3_pipeline.train.optimizer import make_optimizer

        return make_optimizer(_Parameters(self.local), lr)

    @contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s rule over the whole (sharded) gradient; leaves each rank's shard of
        the gradient on its local parameter view for the optimizer."""
        import torch.distributed as dist

        for param, local in zip(self.sharded, self.local):
            local.grad = param.grad.to_local() if param.grad is not None else None
        grads = [local.grad for local in self.local if local.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in grads:
            squares += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        dist.all_reduce(squares)
        total = squares.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total

    def zero_grad(self) -> None:
        for param in self.sharded:
            param.grad = None

    @contextmanager
    def full_parameters(self):
        self.module.unshard()
        try:
            yield
        finally:
            self.module.reshard()

    # --- whole tensors for checkpoints (collectives: every rank calls these) ----------------------------
    def _full(self, local: torch.Tensor, param) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        whole = DTensor.from_local(local, self.mesh, param.placements, run_check=False, shape=param.shape,
                                   stride=param.stride())
        return whole.full_tensor()

    def _local_part(self, full: torch.Tensor, param, what: str) -> torch.Tensor:
        """This rank's dim-0 chunk of a whole tensor, as fully_shard cuts it (torch.chunk; empty past the end)."""
        chunks = torch.chunk(full, self.world_size, dim=0)
        rank = self.info.rank
        part = chunks[rank] if rank < len(chunks) else full[:0]
        expected = tuple(param.to_local().shape)
        if tuple(part.shape) != expected:
            raise RuntimeError(f"{what}: this rank's shard of a {tuple(full.shape)} tensor is {tuple(part.shape)}, "
                               f"but FSDP holds {expected}")
        return part

    def export_model(self) -> nn.Module | None:
        from eagle3_pipeline.formats.checkpoint import expected_tensor_specs
        from eagle3_pipeline.model.drafter import Eagle3Drafter

        names = expected_tensor_specs(self.drafter.config)
        params = dict(self.drafter.named_parameters())
        buffers = dict(self.drafter.named_buffers())
        whole = {}
        with torch.no_grad():
            for name in names:
                if name in params:
                    value = self._full(params[name].to_local(), params[name])
                else:
                    value = buffers[name]
                if self.info.is_main:
                    whole[name] = value.detach().to("cpu")
        if not self.info.is_main:
            return None
        # A drafter on the meta device (no memory) given the whole tensors: what save_drafter writes.
        with torch.device("meta"):
            copy = Eagle3Drafter(self.drafter.config)
        for name, value in whole.items():
            owner, _, leaf = name.rpartition(".")
            module = copy.get_submodule(owner) if owner else copy
            if name in params:
                module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[leaf] = value
        return copy

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state_dict as a single process would have it: every per-parameter tensor whole."""
        local = optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        with torch.no_grad():
            for index, (param, shard) in enumerate(zip(self.sharded, self.local)):
                entry = {}
                for key, value in local["state"].get(index, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape == shard.shape:
                        value = self._full(value, param)
                    entry[key] = value.to("cpu") if torch.is_tensor(value) else value
                if entry:
                    state[index] = entry
        return {"state": state, "param_groups": local["param_groups"]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        from eagle3_pipeline.train.checkpoints import load_optimizer_state

        state = {}
        for index, param in enumerate(self.sharded):
            entry = {}
            for key, value in saved["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape):
                    value = self._local_part(value, param, f"optimizer state {key} of parameter {index}").clone()
                entry[key] = value
            if entry:
                state[index] = entry
        load_optimizer_state(optimizer, {"state": state, "param_groups": saved["param_groups"]})

    def load_weights(self, folder: Path) -> None:
        """A checkpoint's whole tensors into this rank's shards (dtypes must match, as load_weights_exactly)."""
        from safetensors.torch import load_file

        tensors = load_file(str(Path(folder) / "model.safetensors"))
        with torch.no_grad():
            for name, param in self.drafter.named_parameters():
                if not param.requires_grad:
                    continue
                if name not in tensors:
                    raise ValueError(f"{folder}/model.safetensors lacks trainable tensor {name}")
                value = tensors[name]
                if value.dtype != param.dtype:
                    raise ValueError(f"{folder}/model.safetensors holds {name} as {value.dtype} but this run's "
                                     f"drafter is {param.dtype}; resume with the original --dtype")
                param.to_local().copy_(self._local_part(value, param, f"{folder}: {name}"))
            for name, buffer in self.drafter.named_buffers():
                if name in tensors:
                    buffer.copy_(tensors[name])


def make_data_parallel(info: RankInfo, device: str, fsdp: bool) -> DataParallel:
    return (ShardedDataParallel if fsdp else DataParallel)(info, device)
