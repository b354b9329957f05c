"""Stage 04 --online: the verifier runs inside training and computes each batch's aux states and targets on the
device, as stage 02 would have stored them, so nothing but checkpoints and metrics is written (docs/online.md).

The states come from stage 02's own pieces: the capture rule and hook (common.verifier.capture), and the storage
format's rounding (common.formats.storage: bf16 or FP8 aux, final or top-k targets). A batch completed here holds
the very tensors that reading stage 02's files for the same samples would give, laid out as collate lays them.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import Dataset

from common.formats.prepared_data import Sample
from common.formats.storage import StorageFormat, as_sample, dequantize_batch, encode
from common.model.kernels import sdpa_without_cudnn
from common.verifier.capture import LayerInputCapture, TextModel, TokenSelector, capture_batch, find_text_model


def prepared_entries(samples: Sequence[Sample]) -> list[dict]:
    """Index entries of stage 01's samples, as stage 02's index.jsonl lists them (the split and the batch plan
    read id and num_tokens), plus each sample's position in the file."""
    return [{"id": sample.id, "num_tokens": sample.num_tokens, "loss_tokens": int(sample.loss_mask.sum()),
             "position": sample.position} for sample in samples]


class PreparedDataset(Dataset):
    """Stage 01's samples, one per item: token ids and loss mask, cut to max_seq_len. Their states are added on
    the device, batch by batch (OnlineStates)."""

    def __init__(self, samples: Sequence[Sample], entries: Sequence[dict], max_seq_len: int):
        self.entries = list(entries)
        self.samples = [samples[int(entry["position"])] for entry in self.entries]
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.entries)

    def lengths(self) -> list[int]:
        return [min(sample.num_tokens, self.max_seq_len) for sample in self.samples]

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        sample = self.samples[position]
        return {"input_ids": sample.input_ids[: self.max_seq_len], "loss_mask": sample.loss_mask[: self.max_seq_len]}


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def place_rows(values: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """values [N, ...] at `rows` of a zero tensor [count, ...]: the padding of a collated batch. The bytes are
    copied as integers of the same size, since FP8 and unsigned ids have no index_copy on every device."""
    bits = _SAME_SIZE_INT[values.element_size()]
    padded = torch.zeros(count, *values.shape[1:], dtype=bits, device=values.device)
    return padded.index_copy_(0, rows, values.view(bits)).view(values.dtype)


class OnlineStates:
    """The batch_to_device of an online run: a collated batch of token ids goes to the device and gets the
    verifier's states for its real tokens (the padding stays zero, as collate pads stored states).

    The verifier's forward runs without autograd; only the captured rows outlive it, so its activations are
    freed before the drafter's step begins.
    """

    def __init__(self, text: TextModel, aux_layers: Sequence[int], storage: StorageFormat,
                 lm_head: torch.Tensor | None):
        self.text, self.storage, self.lm_head = text, storage, lm_head
        self.capture = LayerInputCapture(text.layers, aux_layers)
        self.store_dtype = getattr(torch, storage.dtype)

    def __call__(self, batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
        real = batch["attention_mask"].flatten().nonzero().squeeze(1)  # on the host: no device sync
        non_blocking = torch.device(device).type == "cuda"
        batch = {key: value.to(device, non_blocking=non_blocking) for key, value in batch.items()}
        # stage 02's rule: cast to --dtype as gathered, or keep the computed values when the format encodes them
        select = TokenSelector(real, self.store_dtype if self.storage.as_computed else None)
        with torch.no_grad(), sdpa_without_cudnn():
            packed = capture_batch(self.text, self.capture, batch["input_ids"], select)
            if not self.storage.as_computed:
                packed = encode(self.storage, packed[:-1], packed[-1], self.lm_head)
        rows = real.to(packed[0].device, non_blocking=non_blocking)
        shape = batch["input_ids"].shape
        for key, values in as_sample(self.storage, packed).items():
            batch[key] = place_rows(values, rows, shape.numel()).unflatten(0, tuple(shape))
        return dequantize_batch(batch)

    def close(self) -> None:
        self.capture.remove()


def load_online_states(args, inputs, device: str, compute_dtype: str, log) -> OnlineStates:
    """The verifier loaded whole on this rank's device (stage 02's loader and text-model finder) behind an
    OnlineStates, for the layers and format `inputs` describe. Top-k targets take the verifier's own lm_head, as
    stage 02's do."""
    from common.formats.storage import format_of_args
    from common.verifier.loading import load_verifier_model

    storage, aux_layers = format_of_args(args, inputs.verifier.vocab_size), inputs.aux_layers
    log.info("--online: loading the verifier %s on %s (%s) to compute the states of every batch", args.model_path,
             device, compute_dtype)
    started = time.time()
    model = load_verifier_model(args.model_path, device, compute_dtype, args.trust_remote_code)
    text = find_text_model(model, inputs.verifier.num_layers)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    lm_head = getattr(text.lm_head, "weight", None) if storage.targets == "topk" else None
    log.info("--online: verifier loaded in %.0f s (text model at %s); aux layers %s, stored format %s (%s)",
             time.time() - started, text.name, list(aux_layers), storage.key(), storage.dtype)
    return OnlineStates(text, aux_layers, storage, lm_head)


def check_online_source(args, log) -> tuple[dict, list[dict], list[Sample], str]:
    """--online's inputs, checked before anything loads: the verifier's config, the aux layers (--aux-layers, or
    the servers' default) and the storage format, and stage 01's prepared data. Returns (the description of the
    states, in stage 02's manifest's words; the index entries of the samples with loss tokens; the samples; the
    name messages give the source)."""
    from common.cli.errors import UsageError
    from common.formats.files import sha256_file
    from common.formats.hidden_states import describe_states
    from common.formats.layer_ids import check_aux_layers, default_aux_layers
    from common.formats.manifest import MANIFEST
    from common.formats.prepared_data import check_prepared_data
    from common.formats.storage import format_of_args
    from common.train.parameters import compute_dtype_for
    from common.verifier.fingerprint import weights_fingerprint
    from common.verifier.loading import pick_device, read_verifier_info

    if not args.prepared_data:
        raise UsageError("--online computes the states from stage 01's output: give --prepared-data (or --run-dir)")
    if not args.model_path:
        raise UsageError("--online runs the verifier inside training: give --model-path")
    info = read_verifier_info(args.model_path, args.trust_remote_code)
    layers = list(args.aux_layers) if args.aux_layers else default_aux_layers(info.num_layers)
    aux_layers = check_aux_layers(layers, info.num_layers)
    storage = format_of_args(args, info.vocab_size)
    samples, _ = check_prepared_data(args, info, log)
    entries = [entry for entry in prepared_entries(samples) if entry["loss_tokens"] > 0]
    if not entries:
        raise UsageError(f"--prepared-data {args.prepared_data}: no sample has loss tokens; rerun 01_prepare_data.py "
                         f"on data with assistant turns")
    upstream = Path(args.prepared_data).parent / MANIFEST
    description = describe_states(info, weights_fingerprint(args.model_path), aux_layers, args.dtype,
                                  compute_dtype_for(pick_device(args.device), args.dtype), storage)
    description.update(source="online", inputs={"prepared_data": {"path": str(Path(args.prepared_data).resolve()),
                                                                  "manifest_sha256": sha256_file(upstream)}})
    return description, entries, samples, f"{upstream} (--online)"
