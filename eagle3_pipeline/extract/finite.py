"""NaN and inf in captured hidden states: found on the device before anything is written (one reduction per
batch), then traced, only when present, to the samples and the layer where they first appear. Both backends can
call these; a sample with non-finite states stops stage 02 (exit 1) or, with --skip-nonfinite, is left out."""
from __future__ import annotations

from typing import Sequence

import torch

from eagle3_pipeline.errors import StageFailure
from eagle3_pipeline.formats.hidden_states import AUX_FILES, FINAL_FILE


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool on the first tensor's device, True when every value is finite. Each tensor's min and max (one
    kernel, no temporary of the tensor's size) carry any NaN, +inf or -inf in it."""
    bounds = [torch.stack(torch.aminmax(t)).to(tensors[0].device) for t in tensors if t.numel()]
    if not bounds:
        return torch.ones((), dtype=torch.bool)
    return torch.isfinite(torch.cat(bounds)).all()


def layer_names(aux_layers: Sequence[int]) -> list[str]:
    """What each captured tensor is, in the order the residual stream passes them."""
    return [f"the input of decoder layer {layer} ({name})" for layer, name in zip(aux_layers, AUX_FILES)] + \
        [f"the final hidden state ({FINAL_FILE})"]


def first_nonfinite(rows: Sequence[torch.Tensor], names: Sequence[str]) -> str | None:
    """Where one sample's values stop being finite (`rows` in the order of `names`), or None."""
    for tensor, name in zip(rows, names):
        if not bool(torch.isfinite(tensor).all()):
            return name
    return None


def nonfinite_failure(found: dict[str, str]) -> StageFailure:
    """The error for samples {id: where}: named with the layer, and the two ways on."""
    listed = "\n  ".join(f"{sample_id!r}: first in {where}" for sample_id, where in list(found.items())[:20])
    more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
    return StageFailure(f"the verifier's hidden states hold NaN or inf for {len(found)} sample(s); nothing of them was "
                        f"written:\n  {listed}{more}\nCheck the verifier (its weights, --dtype: float16 overflows "
                        f"where bfloat16 does not), or pass --skip-nonfinite to leave such samples out (they are "
                        f"counted in the manifest); samples already written are kept, so rerunning resumes")
