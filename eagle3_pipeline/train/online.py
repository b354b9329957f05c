"""Stage 04 --online: the verifier runs inside training and computes each batch's aux states and targets on the
device, as stage 02 would have stored them, so nothing but checkpoints and metrics is written (docs/online.md).

The states come from stage 02's own pieces: the capture rule and hook (eagle3_pipeline.verifier.capture), and the
storage format's rounding (eagle3_pipeline.formats.storage: bf16 or FP8 aux, final or top-k targets). A batch completed
here holds the tensors that reading stage 02's files for the same samples would give, laid out as collate lays them (to
float rounding: the verifier's forward sees other batches than stage 02's).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.utils.data import Dataset

from eagle3_pipeline.formats.prepared_data import Sample
from eagle3_pipeline.formats.storage import StorageFormat, as_sample, dequantize_batch, encode
from eagle3_pipeline.model.kernels import sdpa_without_cudnn
from eagle3_pipeline.verifier.capture import LayerInputCapture, TextModel, TokenSelector, capture_batch, find_text_model


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

    def mark_checked(self, positions) -> None:
        """(As HiddenStateDataset's: no files here to check.)"""


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# A verifier's forward costs a fixed host time (SmolLM2's 30 layers launch about 1,000 kernels, about 20 ms on an
# H200) besides its FLOPs: a pass takes the micro-batches of several steps when the verifier is small.
PASS_PARAMETERS = 1_000_000_000  # micro-batches a pass = this // the verifier's parameters, 1 to MAX_BATCHES_PER_PASS
MAX_BATCHES_PER_PASS = 8


def batches_per_pass(parameters: int) -> int:
    """How many micro-batches one pass of a verifier of this size makes ready (1 from 1B parameters on)."""
    return max(1, min(MAX_BATCHES_PER_PASS, PASS_PARAMETERS // max(parameters, 1)))


def rows_of(micro_batches: Sequence[dict]) -> list[Sample]:
    """Every real row of the micro-batches, as stage 02's plan takes samples (position = its order here)."""
    rows = []
    for batch in micro_batches:
        for ids, mask, length in zip(batch["input_ids"], batch["loss_mask"], batch["attention_mask"].sum(1).tolist()):
            rows.append(Sample(position=len(rows), id=str(len(rows)), input_ids=ids[:length], loss_mask=mask[:length]))
    return rows


class OnlineStates:
    """Where an online run's states come from: the verifier computes them for the loader's batches of token ids.

    The micro-batches of `steps_per_pass` optimizer steps are made ready together: their rows go through the
    verifier as stage 02 would batch them (longest first, at most `pass_tokens` padded tokens a forward), so a small
    verifier's fixed cost per forward is paid once for several micro-batches. A run resumed within a pass computes
    that pass whole (the Trainer starts its loader at the pass's first step), so the states are bit for bit those
    of the uninterrupted run. Each micro-batch is laid out as collate lays out stored samples (padding zero). The
    verifier's forward runs without autograd: only the captured rows outlive it.
    """

    online = True

    def __init__(self, text: TextModel, aux_layers: Sequence[int], storage: StorageFormat,
                 lm_head: torch.Tensor | None, steps_per_pass: int = 1, pass_tokens: int = 1 << 30):
        self.text, self.storage, self.lm_head = text, storage, lm_head
        self.steps_per_pass, self.pass_tokens = steps_per_pass, pass_tokens
        self.capture = LayerInputCapture(text.layers, aux_layers)
        self.store_dtype = getattr(torch, storage.dtype)

    def step_batches(self, batches: Iterator[dict], steps: Sequence, first: int, device) -> Iterator[tuple]:
        """As StoredStates.step_batches, with the micro-batches on the device and their states added."""
        for begin in range(0, len(steps), self.steps_per_pass):
            chunk = steps[begin:begin + self.steps_per_pass]
            waited = time.time()
            groups = [[next(batches) for _ in share] for _, share in chunk]
            waited = time.time() - waited
            ready = iter(self.complete_all([batch for group in groups for batch in group], device))
            for index, ((end, share), group) in enumerate(zip(chunk, groups)):
                done = [next(ready) for _ in group]
                if begin + index >= first:
                    yield end, share, done, waited
                    waited = 0.0

    def complete(self, batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
        """One loader batch on the device with its states (validation)."""
        return self.complete_all([batch], device)[0]

    def complete_all(self, micro_batches: Sequence[dict], device) -> list[dict[str, torch.Tensor]]:
        """Loader batches on the device with their states, from as few verifier forwards as stage 02's plan gives."""
        from eagle3_pipeline.extract.plan import batch_inputs, plan_batches

        non_blocking = torch.device(device).type == "cuda"
        rows = rows_of(micro_batches)
        shapes = [tuple(batch["input_ids"].shape) for batch in micro_batches]
        starts = [0]  # each micro-batch's first place in the flat buffers, [B x S] places each
        for count, width in shapes:
            starts.append(starts[-1] + count * width)
        place = [starts[index] + row * width for index, (count, width) in enumerate(shapes) for row in range(count)]
        buffers: dict[str, torch.Tensor] = {}
        dtypes: dict[str, torch.dtype] = {}
        for members in plan_batches(rows, 1 << 30, self.pass_tokens):
            ids, real = batch_inputs(rows, members, pin=non_blocking)
            into = torch.cat([place[j] + torch.arange(rows[j].num_tokens) for j in members])
            for key, values in self.states(ids, real, device).items():
                bits = _SAME_SIZE_INT[values.element_size()]  # FP8 and unsigned ids have no index_copy everywhere
                if key not in buffers:
                    buffers[key] = torch.zeros(starts[-1], *values.shape[1:], dtype=bits, device=values.device)
                    dtypes[key] = values.dtype
                buffers[key].index_copy_(0, into.to(values.device, non_blocking=non_blocking), values.view(bits))
        ready = []
        for index, batch in enumerate(micro_batches):
            batch = {key: value.to(device, non_blocking=non_blocking) for key, value in batch.items()}
            for key, buffer in buffers.items():
                batch[key] = buffer[starts[index]:starts[index + 1]].view(dtypes[key]).unflatten(0, shapes[index])
            ready.append(dequantize_batch(batch))
        return ready

    def states(self, ids: torch.Tensor, real: torch.Tensor, device) -> dict[str, torch.Tensor]:
        """One verifier forward over right-padded `ids`: the rows of its real tokens (flat positions `real`) under
        load_sample's keys, cast or encoded as stage 02 stores them."""
        select = TokenSelector(real, self.store_dtype if self.storage.as_computed else None)
        with torch.no_grad(), sdpa_without_cudnn():
            packed = capture_batch(self.text, self.capture, ids.to(device, non_blocking=True), select)
            if not self.storage.as_computed:
                packed = encode(self.storage, packed[:-1], packed[-1], self.lm_head)
        return as_sample(self.storage, packed)

    def close(self) -> None:
        self.capture.remove()


def load_online_states(args, inputs, device: str, compute_dtype: str, log) -> OnlineStates:
    """The verifier loaded whole on this rank's device (stage 02's loader and text-model finder) behind an
    OnlineStates, for the layers and format `inputs` describe. Top-k targets take the verifier's own lm_head, as
    stage 02's do."""
    from eagle3_pipeline.formats.storage import format_of_flags
    from eagle3_pipeline.verifier.loading import load_verifier_model

    storage = format_of_flags(args.dtype, args.aux_dtype, args.targets, args.target_topk, inputs.verifier.vocab_size)
    aux_layers = inputs.aux_layers
    log.info("--online: loading the verifier %s on %s (%s) to compute the states of every batch", args.model_path,
             device, compute_dtype)
    started = time.time()
    model = load_verifier_model(args.model_path, device, compute_dtype, args.trust_remote_code)
    text = find_text_model(model, inputs.verifier.num_layers)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    lm_head = getattr(text.lm_head, "weight", None) if storage.targets == "topk" else None
    per_pass = batches_per_pass(sum(parameter.numel() for parameter in text.base.parameters()))
    steps_per_pass = max(1, per_pass // args.grad_accum)
    log.info("--online: verifier loaded in %.0f s (text model at %s); aux layers %s, stored format %s (%s); the "
             "states of %d optimizer step(s) a pass, forwards of at most %d padded tokens", time.time() - started,
             text.name, list(aux_layers), storage.key(), storage.dtype, steps_per_pass, per_pass * inputs.max_tokens)
    return OnlineStates(text, aux_layers, storage, lm_head, steps_per_pass, per_pass * inputs.max_tokens)


def check_online_source(args, log) -> tuple[dict, list[dict], list[Sample], str]:
    """--online's inputs, checked before anything loads: the verifier's config, the aux layers (--aux-layers, or
    the servers' default) and the storage format, and stage 01's prepared data. Returns (the description of the
    states, in stage 02's manifest's words; the index entries of the samples with loss tokens; the samples; the
    name messages give the source)."""
    from eagle3_pipeline.errors import UsageError
    from eagle3_pipeline.formats.files import sha256_file
    from eagle3_pipeline.formats.hidden_states import describe_states
    from eagle3_pipeline.formats.layer_ids import check_aux_layers, default_aux_layers
    from eagle3_pipeline.formats.manifest import MANIFEST
    from eagle3_pipeline.formats.prepared_data import check_prepared_data
    from eagle3_pipeline.formats.storage import format_of_flags
    from eagle3_pipeline.train.parameters import compute_dtype_for
    from eagle3_pipeline.verifier.fingerprint import weights_fingerprint
    from eagle3_pipeline.verifier.loading import pick_device, read_verifier_info

    if not args.prepared_data:
        raise UsageError("--online computes the states from stage 01's output: give --prepared-data (or --run-dir)")
    if not args.model_path:
        raise UsageError("--online runs the verifier inside training: give --model-path")
    info = read_verifier_info(args.model_path, args.trust_remote_code)
    layers = list(args.aux_layers) if args.aux_layers else default_aux_layers(info.num_layers)
    aux_layers = check_aux_layers(layers, info.num_layers)
    storage = format_of_flags(args.dtype, args.aux_dtype, args.targets, args.target_topk, info.vocab_size)
    samples, _ = check_prepared_data(args.prepared_data, args.model_path, args.max_seq_len, info, log)
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
