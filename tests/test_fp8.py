"""FP8 training GEMMs (eagle3_pipeline/model/kernels.py, stage 04's --fp8), run on the CPU, whose torch._scaled_mm
computes the same FP8 products as the GPU's tensor cores (slowly).

FP8 is approximate by design: the checks are that each product stays within FP8's rounding of the exact
one (and is not exact, so the FP8 path really ran), that the weight copies follow optimizer updates, that
the TTT loss and its gradients track full precision, and that a drafter learns as well with it.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from eagle3_pipeline.train.loss import ttt_loss
from eagle3_pipeline.model import kernels
from eagle3_pipeline.model.kernels import E4M3, E5M2, Bf16Gemms, Fp8Gemms, linear, quantize
from tests.test_drafter import assert_overfits_a_fixed_batch, random_batch, tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.double() - exact).norm() / exact.norm())


def operands(M: int, K: int, N: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # rows of different magnitudes, as activations have: one per-tensor scale must cover them all
    x = torch.randn(M, K, generator=gen) * torch.logspace(-1, 1, M)[:, None]
    w = torch.randn(N, K, generator=gen) * 0.05
    g = torch.randn(M, N, generator=gen) * 1e-3
    return x, w, g


def test_fp8_products_are_within_fp8_rounding_of_the_exact_ones():
    x, w, g = operands(64, 48, 32)
    fp8 = Fp8Gemms()
    exact = {"linear": x.double() @ w.double().t(), "grad_input": g.double() @ w.double(),
             "grad_weight": g.double().t() @ x.double()}
    grad_input, grad_weight = fp8.backward(g, w, x)
    got = {"linear": fp8.linear(x, w), "grad_input": grad_input, "grad_weight": grad_weight}
    for name, value in got.items():
        assert value.dtype == torch.float32 and value.shape == exact[name].shape, name
        err = relative_error(value, exact[name])
        # e4m3 keeps 3 mantissa bits, e5m2 2: a few per cent per product, never exact
        assert 1e-4 < err < 0.08, (name, err)


def test_one_cast_gives_both_layouts_and_the_scale_of_the_largest_value():
    x, _, g = operands(64, 48, 32)
    for tensor, dtype in ((x, E4M3), (g, E5M2)):
        rows, cols, inv = quantize(tensor, dtype, rows=True, cols=True)
        assert rows.dtype == dtype and rows.shape == tensor.shape and cols.shape == tensor.t().shape
        assert cols.is_contiguous() and torch.equal(cols.float(), rows.t().float())
        torch.testing.assert_close(inv, tensor.abs().max() / torch.finfo(dtype).max)
        assert float(rows.float().abs().max()) == torch.finfo(dtype).max  # the largest value maps to the top


def test_input_gradient_can_be_added_into_an_existing_tensor():
    x, w, g = operands(64, 48, 32)
    for gemms in (Bf16Gemms(), Fp8Gemms()):
        alone, _ = gemms.backward(g, w, None, need_weight=False)
        acc = torch.ones(64, 48)
        added, _ = gemms.backward(g, w, None, need_weight=False, add_input_to=acc)
        torch.testing.assert_close(added, alone + 1)


def test_shapes_fp8_kernels_cannot_take_fall_back_to_the_model_dtype():
    x, w, g = operands(60, 48, 32)  # 60 rows: not a multiple of 16
    fp8, plain = Fp8Gemms(), Bf16Gemms()
    assert torch.equal(fp8.linear(x, w), plain.linear(x, w))
    for got, expected in zip(fp8.backward(g, w, x), plain.backward(g, w, x)):
        assert torch.equal(got, expected)


def test_weight_copies_are_made_once_and_follow_in_place_updates(monkeypatch):
    x, w, _ = operands(32, 48, 32)
    fp8 = Fp8Gemms()
    first = fp8.linear(x, w)
    assert torch.equal(fp8.linear(x, w), first)
    quantized = []
    real_weight = Fp8Gemms.weight

    def counting_weight(self, tensor):
        quantized.append(self._weights.get(tensor) is None or self._weights.get(tensor)[0] != tensor._version)
        return real_weight(self, tensor)

    monkeypatch.setattr(Fp8Gemms, "weight", counting_weight)
    fp8.linear(x, w)
    assert quantized == [False]  # reused while the weight is unchanged
    with torch.no_grad():
        w.mul_(2)  # what an optimizer step does: an in-place update
    doubled = fp8.linear(x, w)
    assert quantized == [False, True]
    torch.testing.assert_close(doubled, 2 * first, rtol=1e-5, atol=1e-6)


def test_fp8_ttt_loss_and_gradients_track_full_precision(monkeypatch):
    calls = []
    real_scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real_scaled_mm(*a, **k))
    batch = random_batch(B=2, S=32, dtype=torch.float32, pad=3)
    results = {}
    for fp8 in (False, True):
        model, lm_head = tiny_model(dtype=torch.float32, intermediate_size=32)
        model.use_fp8(fp8)
        loss, metrics = ttt_loss(model, batch, lm_head.float(), 4)
        loss.backward()
        results[fp8] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # fc, q/k/v/o, the MLP and lm_head all ran in FP8: forward, grad_input and grad_weight for each
    assert len(calls) >= 4 * (3 + 4 + 3 + 1)
    (loss32, grads32), (loss8, grads8) = results[False], results[True]
    assert abs(loss8 - loss32) / loss32 < 0.02, (loss8, loss32)
    assert grads32.keys() == grads8.keys()
    for name, grad in grads32.items():
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), grads8[name].flatten(), dim=0)
        assert cosine > 0.97, (name, float(cosine))


def test_fp8_only_applies_while_autograd_records():
    x, w, _ = operands(32, 48, 32)
    with torch.no_grad():
        assert torch.equal(linear(x, w, Fp8Gemms()), torch.nn.functional.linear(x, w))


def test_a_drafter_learns_as_well_with_fp8():
    """The overfitting check of test_drafter, with every GEMM in FP8."""
    model, lm_head = tiny_model(dtype=torch.float32, intermediate_size=32)
    model.use_fp8()
    assert_overfits_a_fixed_batch(model, lm_head)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile's CPU backend (Inductor) needs a C++ compiler, and none is installed")
def test_compiled_fp8_casts_compile_once_per_variant(monkeypatch):
    """On a GPU every FP8 cast runs through torch.compile. The six casts (two formats, row-major and/or
    transposed) are called with activations that require gradients and with weights and gradients that do
    not, at several shapes; here compiled on the CPU, none may exhaust torch.compile's recompile limit (which
    silently sends every cast back to slow eager ops), and each must give the eager cast's values."""
    torch._dynamo.reset()
    monkeypatch.setattr(kernels.CompiledOnCuda, "devices", ("cuda", "cpu"))
    for wrapper in kernels._CASTS.values():
        monkeypatch.setattr(wrapper, "compiled", None)
        monkeypatch.setattr(wrapper, "failed", False)
    gen = torch.Generator().manual_seed(0)
    for rows_count in (32, 48, 80):
        for requires_grad in (True, False):
            x = torch.randn(rows_count, 64, generator=gen, dtype=torch.bfloat16).requires_grad_(requires_grad)
            for dtype, rows, cols in kernels._CASTS:
                got = quantize(x, dtype, rows=rows, cols=cols)
                expected = kernels._scaled_cast(x.detach(), kernels.amax(x.detach()), dtype, rows, cols)
                for g, e in zip(got, expected):
                    if e is not None:
                        torch.testing.assert_close(g.float(), e.float(), rtol=0, atol=0)
    # a compile failure (the recompile limit included) warns and falls back to eager ops for good
    assert [name for name, wrapper in kernels._CASTS.items() if wrapper.failed] == []
    assert all(wrapper.compiled is not None for wrapper in kernels._CASTS.values())
    torch._dynamo.reset()
