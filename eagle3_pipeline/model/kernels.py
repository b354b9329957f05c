"""GPU kernels the drafter trains with: fused elementwise code (CompiledOnCuda) and FP8 / bf16 GEMMs.

docs/model.md (Kernels) explains the FP8 scaling, when weights are quantized and what falls back.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

E4M3 = torch.float8_e4m3fn  # weights and activations
E5M2 = torch.float8_e5m2  # gradients
FP8_ALIGN = 16  # cuBLAS FP8 GEMMs need every dimension to be a multiple of 16


class CompiledOnCuda:
    """`fn` through torch.compile on CUDA tensors, the same Python `fn` run eagerly everywhere else.

    The functions wrapped here are chains of elementwise ops and row reductions that eager PyTorch runs as
    many kernels, each reading and writing whole [rows, width] tensors (often upcast to fp32); compiled they
    become one or two fused kernels that read the bf16 inputs once and keep the fp32 intermediates in
    registers. The maths is the same Python code either way. Compilation happens on the first CUDA call;
    if it fails (no Triton, an unsupported op) the eager function is used from then on, with a warning.
    EAGLE3_COMPILE=0 turns compilation off. `devices`: the device types compiled for (tests add "cpu").
    """

    devices = ("cuda",)

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.failed = os.environ.get("EAGLE3_COMPILE", "1") == "0"

    def __call__(self, *args):
        if self.failed or args[0].device.type not in self.devices:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        try:
            return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - any compile failure means: eager ops from now on
            warnings.warn(f"torch.compile of {self.fn.__name__} failed ({type(err).__name__}: {err}); "
                          "using eager ops")
            self.failed = True
            return self.fn(*args)


# =====================================================================================================
# FP8
# =====================================================================================================

def amax(x: Tensor) -> Tensor:
    """max |x| in fp32: one eager multi-block reduction (compiled with dynamic shapes, a reduction over a
    whole tensor may end up in a single program, far slower than the GEMM it prepares)."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def _scaled_cast(x: Tensor, x_amax: Tensor, dtype: torch.dtype, rows: bool, cols: bool):
    """x (2-D) in `dtype`, scaled so that its largest |value| is the format's largest: as is (rows) and/or
    transposed and contiguous (cols, for operands cuBLAS wants column-major), from one read of x; and the
    inverse scale (x ~= result * inv_scale)."""
    top = torch.finfo(dtype).max
    scale = top / x_amax.clamp(min=1e-12)
    q = (x.float() * scale).clamp(-top, top).to(dtype)
    return (q.contiguous() if rows else None), (q.t().contiguous() if cols else None), scale.reciprocal()


def _compiled_cast(dtype: torch.dtype, rows: bool, cols: bool) -> CompiledOnCuda:
    def cast(x: Tensor, x_amax: Tensor):
        return _scaled_cast(x, x_amax, dtype, rows, cols)

    name = f"cast_to_{str(dtype).split('.')[-1]}{'_rows' if rows else ''}{'_cols' if cols else ''}"
    # torch.compile caches compiled variants per code object, at most 8 of them: the six closures made here
    # would share one code object and evict each other until compilation gives up, so each gets its own.
    cast.__code__ = cast.__code__.replace(co_name=name)
    cast.__name__ = cast.__qualname__ = name
    return CompiledOnCuda(cast)


_CASTS = {(dtype, rows, cols): _compiled_cast(dtype, rows, cols)
          for dtype in (E4M3, E5M2) for rows, cols in ((True, False), (False, True), (True, True))}


def quantize(x: Tensor, dtype: torch.dtype, rows: bool = True, cols: bool = False):
    """(x as `dtype` row-major or None, x.T contiguous as `dtype` or None, inverse scale); see _scaled_cast.
    Never differentiated: x is detached, so the compiled cast sees one kind of input whatever x's autograd
    state (a requires_grad change would otherwise compile it again)."""
    x = x.detach()
    return _CASTS[(dtype, rows, cols)](x, amax(x))


def _scaled_mm(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype,
               fast_accum: bool = False) -> Tensor:
    """(a * a_inv) @ (b * b_inv); a row-major [M,K], b column-major [K,N] (cuBLAS's FP8 layout).
    fast_accum lets Hopper's tensor cores skip the periodic promotion of partial sums to fp32: faster, a
    little less exact, so it is used for forward products only (as torchao's float8 training does)."""
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)


class Bf16Gemms:
    """A linear layer's training GEMMs in the model's dtype: linear(x, w) = x @ w.T and
    backward(g, w, x) = (g @ w, g.T @ x), the gradients of the input and of the weight (either can be
    skipped; x is only needed for the weight's). x: [M,K], w: [N,K], g: [M,N]. add_input_to: a tensor the
    input's gradient is added to (and returned), instead of a new one."""

    fp8 = False

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        return F.linear(x, w)

    def new_step(self) -> None:
        """Called once per optimizer step (see Fp8Gemms.new_step)."""

    def backward(self, g: Tensor, w: Tensor, x: Tensor | None, need_input: bool = True,
                 need_weight: bool = True, add_input_to: Tensor | None = None):
        grad_x = grad_w = None
        if need_input:
            grad_x = g.mm(w) if add_input_to is None else torch.addmm(add_input_to, g, w)
        if need_weight:
            grad_w = g.t().mm(x)
        return grad_x, grad_w


class Fp8Gemms(Bf16Gemms):
    """The same GEMMs on FP8 tensor cores (docs/model.md, Kernels); each operand is quantized once per
    use (a gradient once for both of its products), weights once per optimizer step. Shapes that are not
    multiples of 16 use the parent's."""

    fp8 = True

    def __init__(self):
        # weight -> (version, w_e4m3 [N,K], w_e4m3.T contiguous [K,N], inverse scale); weak, so a dropped
        # model takes its FP8 copies with it
        self._weights = WeakIdKeyDictionary()

    def new_step(self) -> None:
        """Forget the weight copies: call it once per optimizer step, before the forward. The version check
        in `weight` alone is not enough: FSDP2 gathers new values into the same tensors without bumping
        their version counters."""
        self._weights = WeakIdKeyDictionary()

    def weight(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cached = self._weights.get(w)
        if cached is None or cached[0] != w._version:
            cached = (w._version, *quantize(w, E4M3, rows=True, cols=True))
            self._weights[w] = cached
        return cached[1:]

    @staticmethod
    def _aligned(*tensors: Tensor | None) -> bool:
        return all(size % FP8_ALIGN == 0 for t in tensors if t is not None for size in t.shape)

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        if not self._aligned(x, w):
            return super().linear(x, w)
        xq, _, x_inv = quantize(x, E4M3)
        wq, _, w_inv = self.weight(w)
        return _scaled_mm(xq, x_inv, wq.t(), w_inv, x.dtype, fast_accum=True)

    def backward(self, g: Tensor, w: Tensor, x: Tensor | None, need_input: bool = True,
                 need_weight: bool = True, add_input_to: Tensor | None = None):
        if not self._aligned(g, w, x):
            return super().backward(g, w, x, need_input, need_weight, add_input_to)
        gq, gq_t, g_inv = quantize(g, E5M2, rows=need_input, cols=need_weight)
        grad_x = grad_w = None
        if need_input:  # g [M,N] @ w [N,K]: w column-major is the cached w.T, viewed back
            _, wq_t, w_inv = self.weight(w)
            grad_x = _scaled_mm(gq, g_inv, wq_t.t(), w_inv, g.dtype)
            if add_input_to is not None:
                grad_x = add_input_to.add_(grad_x)
        if need_weight:  # g.T [N,M] @ x [M,K]: x column-major is x.T contiguous, viewed back
            _, xq_t, x_inv = quantize(x, E4M3, rows=False, cols=True)
            grad_w = _scaled_mm(gq_t, g_inv, xq_t.t(), x_inv, x.dtype)
        return grad_x, grad_w


class _Linear(torch.autograd.Function):
    """x @ w.T with all three GEMMs through `gemms` (weight gradient only; no bias)."""

    @staticmethod
    def forward(ctx, x, w, gemms):
        ctx.gemms = gemms
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        return gemms.linear(x2, w).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x, grad_w = ctx.gemms.backward(g2, w, x.reshape(-1, x.shape[-1]), *ctx.needs_input_grad[:2])
        return (grad_x.view(x.shape) if grad_x is not None else None), grad_w, None


def linear(x: Tensor, weight: Tensor, gemms: Bf16Gemms | None) -> Tensor:
    """x @ weight.T: through `gemms` when it is FP8 and autograd records, else F.linear (inference and
    evaluation always run in the model's dtype)."""
    if gemms is None or not gemms.fp8 or not torch.is_grad_enabled():
        return F.linear(x, weight)
    return _Linear.apply(x, weight, gemms)


def fp8_available(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or newer; the CPU also runs FP8 GEMMs (slowly),
    which the tests use."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def fuse_elementwise() -> bool:
    """EAGLE3_FUSE_ELEMENTWISE=1: compile the TTT step's elementwise islands (a candidate until measured on a GPU
    against the eager ops with scripts/lab/bench_train_step.py --fuse-elementwise; the maths is the same either way)."""
    return os.environ.get("EAGLE3_FUSE_ELEMENTWISE", "0") == "1"


def upcast(x: Tensor) -> Tensor:
    """fp16/bf16 -> fp32 for accumulation; fp32/fp64 unchanged (tests run the math in fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


@contextmanager
def sdpa_without_cudnn():
    """Run SDPA (the verifier's attention, the drafter's causal step) without cuDNN's kernel; usable as a
    decorator too.

    PyTorch tries cuDNN's attention first on Hopper and Blackwell GPUs with a recent cuDNN (torch 2.11 with
    CUDA 13 does), and cuDNN builds an execution graph for every new input shape: decoding changes the key
    length at every token, regeneration, extraction and training the shape at every batch. On an H200,
    SmolLM2's bf16 decoding ran at 18 to 141 tokens/s from prompt to prompt with it (fp32, where it does not
    apply: 100 to 131), and it took 150 of stage 04's 197 ms step
    (docs/results/2026-12-02-h200-lossless-loop-cudnn.md).
    Flash and memory-efficient attention need no such build. EAGLE3_CUDNN_ATTENTION=1 keeps PyTorch's choice,
    to measure the difference.
    """
    if os.environ.get("EAGLE3_CUDNN_ATTENTION") == "1":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
