"""The decoding step's grouped-head attention as one Triton kernel (the default on a GPU; decode_attention).

The matmul way (decode_attention.matmul_attention) runs a decoding step in two batched GEMMs whose query side
is only a group's few heads, at 2.5-3x one read of the KV cache on an H200; and it reads the whole cache width
from the first new token on, though the positions not written yet are masked. This kernel reads each K/V row
once, in one pass with an online softmax (one program per sequence and K/V head, the group's query heads
padded to 16 rows for tensor-core dots), and loads nothing at the positions the mask hides: the left padding
and the cache's unwritten tail. The mask is a device tensor, so one compiled step with its CUDA graphs serves
every step of a batch. On an H200 at SmolLM2's heads and 1024 x 384 it took 2.2 ms a step against 4.4 for
the matmuls, with OPTIONS, the fastest of `scripts/lab/bench_decode_attention.py --triton-sweep` (with a branch
around each block's loads instead, the best at blocks of 128 took 2.47 ms).

Rounding follows matmul_attention: scores rounded to the inputs' dtype before a float32 softmax, the
probabilities rounded to it before multiplying the values. Float32 inputs use IEEE dots (no TF32). The
output is float32, cast by the caller: Triton's CPU interpreter, which the tests run the kernel in, can
neither store bfloat16 nor dot it, so there every tile is made float32 first (the same products: those of
bfloat16 numbers are exact in float32).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

try:  # the kernels are defined only where Triton is installed
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Query heads of one K/V head are padded to this many rows: tensor-core dots take at least 16.
QUERY_ROWS = 16
# The kernel's options (scripts/lab/bench_decode_attention.py --triton-sweep times others): K/V positions a program
# reads per iteration; whether a block the mask hides entirely is skipped by a branch (else its loads are only
# masked off); Triton's num_warps and num_stages (None: Triton's default).
OPTIONS = {"block": 128, "skip": False, "num_warps": 4, "num_stages": 2}
# Shared memory the K and V tiles of all pipeline stages may take: SM120 GPUs have about 100 KB a block (an H200
# 228 KB), so wider heads or float32 get smaller blocks (block_for).
TILE_BYTES = 64 * 1024


@functools.cache
def available() -> bool:
    """Whether Triton can run the kernel here: on a CUDA GPU, or in its CPU interpreter (TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:  # at module level: Triton resolves a kernel's calls (attend_block) among its module's names
    @triton.jit
    def attend_block(query, best, total, acc, k_ptr, v_ptr, k_offsets, v_offsets, valid, dims, scale, dtype,
                     IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """One block of positions folded into the running max, sum and weighted values (online softmax)."""
        keys = tl.load(k_ptr + k_offsets[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            keys = keys.to(tl.float32)
        if IEEE:
            scores = tl.dot(query, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(keys))
        scores = scores.to(dtype).to(tl.float32) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        shrink = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * shrink + tl.sum(weights, axis=1)
        values = tl.load(v_ptr + v_offsets[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        weights = weights.to(dtype)
        if UPCAST:
            values = values.to(tl.float32)
            weights = weights.to(tl.float32)
        if IEEE:
            acc = acc * shrink[:, None] + tl.dot(weights, values, input_precision="ieee")
        else:
            acc = acc * shrink[:, None] + tl.dot(weights, values)
        return new_best, total, acc

    @triton.jit
    def gqa_decode_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, kv_len, scale,
                          q_batch, q_head, k_batch, k_head, k_pos, v_batch, v_head, v_pos, m_batch, m_pos,
                          o_batch, o_head,
                          GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_MASK: tl.constexpr, SKIP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        sequence = tl.program_id(0)
        kv_head = tl.program_id(1)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, HEAD_DIM)
        in_group = rows < GROUPS
        heads = kv_head * GROUPS + rows
        query = tl.load(q_ptr + sequence * q_batch + heads[:, None] * q_head + dims[None, :],
                        mask=in_group[:, None], other=0.0)
        dtype = query.dtype
        if UPCAST:
            query = query.to(tl.float32)
        # A finite start: a block that is all masked then leaves the running figures as they are (no inf - inf).
        best = tl.full((ROWS,), -1e30, tl.float32)
        total = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
        k_row = k_ptr + sequence * k_batch + kv_head * k_head
        v_row = v_ptr + sequence * v_batch + kv_head * v_head
        for start in range(0, kv_len, BLOCK):
            positions = start + tl.arange(0, BLOCK)
            valid = positions < kv_len
            if HAS_MASK:
                valid = valid & (tl.load(mask_ptr + sequence * m_batch + positions * m_pos, mask=valid, other=0) != 0)
            if SKIP:
                if tl.sum(valid.to(tl.int32), axis=0) > 0:  # a block the mask hides entirely is not read
                    best, total, acc = attend_block(query, best, total, acc, k_row, v_row, positions * k_pos,
                                                    positions * v_pos, valid, dims, scale, dtype, IEEE, UPCAST)
            else:  # masked lanes load nothing
                best, total, acc = attend_block(query, best, total, acc, k_row, v_row, positions * k_pos,
                                                positions * v_pos, valid, dims, scale, dtype, IEEE, UPCAST)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + sequence * o_batch + heads[:, None] * o_head + dims[None, :], out, mask=in_group[:, None])


@functools.cache
def problem_with(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the kernel cannot decode for a model of these heads and dtype here, or None. It runs once on small
    random inputs (so Triton builds it now, before any batch) and must give the matmuls' result."""
    from eagle3_pipeline.verifier.decode_attention import matmul_attention

    generator = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(2, heads, 1, dim, generator=generator, device=device).to(dtype)
    key, value = (torch.randn(2, kv_heads, 40, dim, generator=generator, device=device).to(dtype) for _ in range(2))
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool, device=device)
    mask[0, ..., :7] = False
    if not supports(query, key, value, mask):
        return None  # these heads never reach the kernel: the matmuls decode them
    try:
        found = triton_decode_attention(query, key, value, mask)
    except Exception as error:  # noqa: BLE001 - whatever Triton raises (out of resources, no backend) is the answer
        return f"{type(error).__name__}: {str(error)[:200]}"
    expected = matmul_attention(query.view(2, kv_heads, heads // kv_heads, dim), key, value, mask)
    gap = (found - expected.reshape(found.shape).float()).abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    return None if gap <= tolerance else f"its result is {gap:.2g} from the matmuls' (more than {tolerance})"


def supports(query, key, value, mask) -> bool:
    """Whether the kernel takes this step: up to QUERY_ROWS query heads per K/V head, one power-of-two head size
    of 16 or more for queries and values, and a boolean mask or none."""
    groups, dim = query.shape[1] // key.shape[1], query.shape[-1]
    return (groups <= QUERY_ROWS and dim >= 16 and not dim & (dim - 1) and value.shape[-1] == dim
            and (mask is None or mask.dtype == torch.bool))


def triton_decode_attention(query, key, value, mask, scaling=None):
    """softmax(q k^T * scale, masked) v for one new token: query (batch, heads, 1, dim), key and value (batch,
    kv_heads, kv_len, dim), `mask` boolean (True: attend) broadcastable to (batch, 1, 1, kv_len) or None;
    returns float32 (batch, heads, 1, dim). A torch custom op: torch.compile keeps it whole in the graph."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.eagle3.triton_decode_attention(query, key, value, mask, float(scale))


@torch.library.custom_op("eagle3::triton_decode_attention", mutates_args=())
def _decode_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
               scale: float) -> torch.Tensor:
    block = block_for(query.shape[-1], query.element_size(), OPTIONS["block"], OPTIONS["num_stages"] or 2)
    return launch(query, key, value, mask, scale, **{**OPTIONS, "block": block})


def block_for(dim: int, element_size: int, block: int, stages: int) -> int:
    """The largest block up to `block` positions (a power of two, 16 or more) whose K and V tiles of all
    `stages` fit TILE_BYTES."""
    while block > 16 and 2 * stages * block * dim * element_size > TILE_BYTES:
        block //= 2
    return block


def launch(query, key, value, mask, scale: float, block: int, skip: bool, num_warps: int,
           num_stages: Optional[int]):
    """The kernel on these tensors (as triton_decode_attention takes them) with these options."""
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if not supports(query, key, value, mask):
        raise ValueError(f"the Triton decoding attention cannot take {groups} query heads per K/V head, head sizes "
                         f"{dim} and {value.shape[-1]}, a {mask.dtype if mask is not None else 'missing'} mask")
    query = query.reshape(batch, heads, dim).contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device=query.device)
    if mask is not None:
        mask = mask.expand(batch, 1, 1, kv_len)[:, 0, 0]  # (batch, kv_len), a view
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
    interpreted = query.device.type == "cpu"  # the interpreter's dots take no bfloat16: they run in float32
    stages = {} if num_stages is None else {"num_stages": num_stages}
    gqa_decode_kernel[(batch, kv_heads)](
        query, key, value, mask if mask is not None else query, out, kv_len, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        mask.stride(0) if mask is not None else 0, mask.stride(1) if mask is not None else 0,
        out.stride(0), out.stride(1),
        GROUPS=groups, HEAD_DIM=dim, ROWS=QUERY_ROWS, BLOCK=block, HAS_MASK=mask is not None, SKIP=skip,
        IEEE=query.dtype == torch.float32 or interpreted, UPCAST=interpreted, num_warps=num_warps, **stages)
    return out.view(batch, heads, 1, dim)


@_decode_op.register_fake
def _decode_op_shape(query, key, value, mask, scale):
    return query.new_empty(query.shape, dtype=torch.float32)
