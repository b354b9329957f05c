"""Stage 02's storage formats: how the aux layers (bf16, or FP8 with a scale per row) and the targets (the final
hidden state, or the verifier's top-k next tokens) are stored, the GPU-side encoding stage 02 applies, and the
decoding stages 04 and 05 apply. Why and what each costs: docs/extraction.md, "Storage formats"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagle3_pipeline.errors import UsageError

AUX_DTYPES = ("bfloat16", "float8_e4m3")
TARGETS = ("final", "topk")
DEFAULT_TOPK = 64
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value: each row's amax is scaled onto it
AUX_SCALE_FILE = "aux_scale.pt"
TOPK_IDS_FILE = "topk_ids.pt"
TOPK_LOGPROBS_FILE = "topk_logprobs.pt"


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer type that holds every token id of a vocabulary."""
    for dtype in (torch.uint8, torch.uint16, torch.int32):
        if vocab_size - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


@dataclass(frozen=True)
class StorageFormat:
    """One stage-02 output's format. aux_dtype: "float8_e4m3", or the --dtype the aux layers are stored in
    unquantised (as before formats existed); targets: "final" or "topk" (with `topk` tokens per position)."""
    aux_dtype: str = "bfloat16"
    targets: str = "final"
    topk: int = DEFAULT_TOPK
    vocab_size: int = 0  # for the ids' integer type (top-k targets only)
    dtype: str = "bfloat16"  # --dtype: the verifier's, and that of bf16 aux and of final

    @property
    def fp8(self) -> bool:
        return self.aux_dtype == "float8_e4m3"

    @property
    def as_computed(self) -> bool:
        """aux and final kept as the verifier computes them, cast to --dtype: nothing to encode on the device."""
        return self.aux_dtype == self.dtype and self.targets == "final"

    def fields(self, hidden_size: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(file, shape of one token's row, dtype) of every per-token tensor, in the order stage 02 packs them."""
        from eagle3_pipeline.formats.hidden_states import AUX_FILES, FINAL_FILE

        aux = FP8 if self.fp8 else getattr(torch, self.aux_dtype)
        fields = [(name, (hidden_size,), aux) for name in AUX_FILES]
        if self.fp8:
            fields.append((AUX_SCALE_FILE, (len(AUX_FILES),), torch.float32))
        if self.targets == "topk":
            fields += [(TOPK_IDS_FILE, (self.topk,), id_dtype(self.vocab_size)),
                       (TOPK_LOGPROBS_FILE, (self.topk,), torch.float16)]
        else:
            fields.append((FINAL_FILE, (hidden_size,), getattr(torch, self.dtype)))
        return fields

    def files(self) -> tuple[str, ...]:
        """Every file of one sample folder (meta last)."""
        from eagle3_pipeline.formats.hidden_states import META_FILE

        return tuple(name for name, _, _ in self.fields(1)) + (META_FILE,)

    def bytes_per_token(self, hidden_size: int) -> int:
        """Bytes of the per-token tensors of one token (meta's ids and mask not included)."""
        total = 0
        for _, shape, dtype in self.fields(hidden_size):
            total += int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        return total

    def key(self) -> str:
        """What decides the stored bytes, in words (part of stage 02's resume key)."""
        return f"aux {self.aux_dtype}, targets " + (f"top-{self.topk}" if self.targets == "topk" else "final")

    def describe(self) -> dict[str, Any]:
        """The manifest's "storage" entry (what the reader needs besides the file names)."""
        record: dict[str, Any] = {"aux_dtype": self.aux_dtype, "targets": self.targets}
        if self.fp8:
            record["aux_scale"] = "float32 per token and layer: value = fp8 * scale, scale = row amax / 448"
        if self.targets == "topk":
            record.update({"target_topk": self.topk, "topk_id_dtype": str(id_dtype(self.vocab_size)).split(".")[-1],
                           "topk_values": "float16 log-probabilities of the full vocabulary (float32 log_softmax)"})
        return record


def format_of_flags(dtype: str, aux_dtype: str, targets: str, target_topk: int, vocab_size: int) -> StorageFormat:
    """The format stage 02's --dtype, --aux-dtype, --targets and --target-topk ask for (stage 04 --online rounds its
    states the same way)."""
    topk = target_topk or DEFAULT_TOPK  # --target-topk 0 has always meant the default
    if topk < 1 or (vocab_size and topk > vocab_size):
        raise UsageError(f"--target-topk {topk}: give 1 to {vocab_size} (the verifier's vocabulary size)")
    aux = "float8_e4m3" if aux_dtype == "float8_e4m3" else dtype
    return StorageFormat(aux, targets, topk, vocab_size, dtype)


def format_of_manifest(manifest: dict, where: str) -> StorageFormat:
    """The format a stage-02 manifest records; outputs written before formats existed are bf16 aux + final.
    Refuses a format this code does not know (a newer stage 02 wrote it)."""
    storage = manifest.get("storage") or {}
    dtype = str(manifest.get("dtype") or "bfloat16")
    aux = storage.get("aux_dtype", dtype)
    targets = storage.get("targets", "final")
    if aux not in AUX_DTYPES + (dtype,) or targets not in TARGETS:
        raise UsageError(f"{where}: hidden states stored as aux {aux!r} with targets {targets!r}, a format this code "
                         f"does not read (it knows aux {', '.join(AUX_DTYPES)} and targets {', '.join(TARGETS)}); "
                         f"update the code or extract again with 02_extract_hidden_states.py")
    verifier = manifest.get("verifier") or {}
    return StorageFormat(aux, targets, int(storage.get("target_topk") or DEFAULT_TOPK),
                         int(verifier.get("vocab_size") or 0), dtype)


# --- encoding (stage 02, on the verifier's device) ------------------------------------------------------------

def quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [N, H] -> (float8_e4m3fn [N, H], float32 scale [N]) with rows ~= fp8 * scale. Each row's largest
    magnitude maps to 448, so one outlier token costs only its own precision."""
    wide = rows.float()
    scale = wide.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (wide / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """values [..., L*H] fp8 with scale [..., L] (one per token and layer) -> [..., L*H] in `dtype`."""
    layers = scale.shape[-1]
    grouped = values.float().unflatten(-1, (layers, values.shape[-1] // layers))
    return (grouped * scale.float()[..., None]).flatten(-2).to(dtype)


@torch.no_grad()
def topk_targets(final: torch.Tensor, lm_head: torch.Tensor, k: int, ids_dtype: torch.dtype,
                 rows_per_pass: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's k most likely next tokens per row of final [N, H]: (ids [N, k] in `ids_dtype`, float16
    log-probabilities [N, k]), from lm_head(final) in float32, a few rows at a time (never [N, V] at once)."""
    weight = lm_head.float()
    ids = torch.empty(final.shape[0], k, dtype=ids_dtype, device=final.device)
    values = torch.empty(final.shape[0], k, dtype=torch.float16, device=final.device)
    for r0 in range(0, final.shape[0], rows_per_pass):
        logprobs = torch.log_softmax(final[r0:r0 + rows_per_pass].float() @ weight.t(), dim=-1)
        top = logprobs.topk(k, dim=-1)
        ids[r0:r0 + rows_per_pass] = top.indices.to(ids_dtype)
        values[r0:r0 + rows_per_pass] = top.values.to(torch.float16)
    return ids, values


def encode(fmt: StorageFormat, aux: list[torch.Tensor], final: torch.Tensor,
           lm_head: torch.Tensor | None) -> list[torch.Tensor]:
    """The gathered rows of one batch (aux [N, H] x 3, final [N, H]) as the tensors of fmt.fields, in order."""
    if fmt.fp8:
        pairs = [quantize_fp8(rows) for rows in aux]
        device = pairs[0][1].device  # (a sharded verifier's layers may sit on several GPUs)
        packed = [values for values, _ in pairs] + [torch.stack([scale.to(device) for _, scale in pairs], dim=-1)]
    else:
        packed = [rows.to(getattr(torch, fmt.aux_dtype)) for rows in aux]
    if fmt.targets == "topk":
        if lm_head is None:
            raise RuntimeError("top-k targets need the verifier's lm_head")
        packed += list(topk_targets(final, lm_head.to(final.device), fmt.topk, id_dtype(fmt.vocab_size)))
    else:
        packed.append(final.to(getattr(torch, fmt.dtype)))
    return packed


def sample_keys(fmt: StorageFormat) -> list[str]:
    """The keys load_sample gives the tensors of fmt.fields (aux_0..2 joined as "aux"), in the same order."""
    from eagle3_pipeline.formats.hidden_states import AUX_FILES

    keys = []
    for name, _, _ in fmt.fields(1):
        key = "aux" if name in AUX_FILES else name.removesuffix(".pt")
        if key not in keys:
            keys.append(key)
    return keys


def as_sample(fmt: StorageFormat, packed: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch's packed rows (fmt.fields order, [N, ...] each) as load_sample returns a sample: aux [N, 3H] and the
    rest under their keys, so stage 04 --online hands the drafter what reading stage 02's files would."""
    from eagle3_pipeline.formats.hidden_states import AUX_FILES

    aux = len(AUX_FILES)
    return dict(zip(sample_keys(fmt), [torch.cat(packed[:aux], dim=-1), *packed[aux:]]))


# --- decoding (stages 04 and 05) ------------------------------------------------------------------------------

def dequantize_batch(batch: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict:
    """A batch on its device with FP8 aux (and "aux_scale") gets aux in `dtype`; other batches are returned as is."""
    if "aux_scale" not in batch:
        return batch
    batch = dict(batch)
    batch["aux"] = dequantize_fp8(batch["aux"], batch.pop("aux_scale"), dtype)
    return batch


def topk_target_distribution(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, t2d: torch.Tensor,
                             draft_vocab: int) -> dict[str, torch.Tensor]:
    """target_distribution's result from stored top-k targets: the kept tokens that are in the draft vocabulary,
    renormalised over their mass. Also "missing_mass" [B, S]: the probability the kept draft tokens do not cover
    (tokens beyond the top k, and those outside the draft vocabulary), reported, not trained on."""
    device = t2d.device
    ids = topk_ids.to(device=device, dtype=torch.int64)
    probs_kept = topk_logprobs.to(device).float().exp()
    in_draft_col = t2d[ids]
    draft_index = (torch.cumsum(t2d.to(torch.int64), 0) - 1)[ids].clamp(min=0)
    weights = probs_kept * in_draft_col
    probs = torch.zeros(*ids.shape[:-1], draft_vocab, dtype=torch.float32, device=device)
    probs.scatter_add_(-1, draft_index, weights)
    mass = weights.sum(-1)
    probs = probs / mass.clamp(min=1e-20)[..., None]
    return {"probs": probs, "argmax": probs.argmax(-1), "in_draft": in_draft_col[..., 0],
            "missing_mass": 1.0 - mass}
