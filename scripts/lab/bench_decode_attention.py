#!/usr/bin/env python3
"""One decoding step's attention over a left-padded static KV cache, several ways, on the same tensors.

Stage 01's "static" and "loop" engines decode one token per row against a StaticCache of the batch's full
width, with a padding mask. transformers' SDPA attention would repeat every key/value head for its query
group (repeat_kv: SDPA's own GQA support is used only without a mask); the engines instead fold the groups
(eagle3_pipeline.verifier.decode_attention). The ways, on the same tensors:

  repeat   what transformers does with a mask: K/V repeated to the query heads, then SDPA
  gqa      SDPA with enable_gqa=True on the unrepeated K/V
  folded   the query heads of a group folded into the query length ([B, kv, group, D]): every K/V head
           is read once, by a query block of `group` rows that share one position and one mask row (the
           engines' way today: eagle3_pipeline.verifier.decode_attention.folded_decode_attention)
  matmul   the same folding as two batched matmuls and a softmax (no attention kernel: cuBLAS reads the
           cache as a batched matrix-vector product; the engines' EAGLE3_DECODE_ATTENTION=matmul candidate)
  reduce   the same folding as multiplies and sums, for inductor to fuse into reductions when compiled (eager it
           materialises every product, so time it with --compile); slower than matmul on an H200
  triton   the engines' way on a GPU: one Triton kernel, each K/V row read once with an online softmax,
           nothing loaded where the mask hides (padding, the unwritten tail) (eagle3_pipeline.verifier.triton_decode);
           a custom op, so --compile keeps it whole
  flex     torch's FlexAttention, compiled, with the padding as a block mask and enable_gqa: at one query a
           row it runs its split-KV decoding kernel (the block mask is built once per shape, outside the timing)

With --triton-sweep the triton way is also timed at each of its kernel's options (block, skip, num_warps,
num_stages; eagle3_pipeline.verifier.triton_decode.OPTIONS is the one the engines run).

With --compile every way but flex is timed as torch.compile(dynamic=False) makes it, as the loop engine runs
its decoding step (flex is compiled either way).

Each is timed with CUDA events over --iters calls, after a warm-up, under
eagle3_pipeline.model.kernels.sdpa_without_cudnn (as the engine runs), and checked against `repeat` (max abs
difference). The lower bound printed beside them is one read of K and V at --bandwidth GB/s.

  python scripts/lab/bench_decode_attention.py [--shapes 1024x384,624x512,180x1280] [--heads 9 --kv-heads 3 --head-dim 64]

The defaults are SmolLM2-135M's heads and the batch shapes (rows x cache width) of bench_regenerate's warm
loop call on 2026-12-02; --heads 32 --kv-heads 8 --head-dim 128 is Llama-3.1-8B's.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F

from eagle3_pipeline.model.kernels import sdpa_without_cudnn
from eagle3_pipeline.verifier.decode_attention import folded_decode_attention


def attention_repeat(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def attention_folded(q, k, v, mask):
    return folded_decode_attention(q, k, v, mask)


def attention_matmul(q, k, v, mask):
    return folded_decode_attention(q, k, v, mask, way="matmul")


def attention_reduce(q, k, v, mask):
    """The folded step as multiplies and sums in float32 (rounded where the matmuls round), for inductor to
    fuse into reductions; the scores laid out [batch, kv, width, group] so a group's rows share each K read.
    Measured slower than matmul on an H200, compiled (docs/results/2026-12-03-h200-regen-loop-llama.md)."""
    batch, heads, _, dim = q.shape
    grouped = q.view(batch, k.shape[1], heads // k.shape[1], dim)
    scores = (k.float().unsqueeze(-2) * grouped.float().unsqueeze(-3)).sum(-1)  # [b, kv, width, group]
    scores = scores.to(q.dtype).float() * dim ** -0.5
    scores = scores.masked_fill(~mask.transpose(-1, -2), float("-inf"))
    weights = scores.softmax(dim=-2).to(v.dtype)
    output = (weights.float().unsqueeze(-1) * v.float().unsqueeze(-2)).sum(-3)  # [b, kv, group, dim]
    return output.to(v.dtype).reshape(batch, heads, 1, v.shape[-1])


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def block_mask(mask):
    """The padding mask [rows, 1, 1, width] as FlexAttention's block mask, once per mask (outside the timing)."""
    from torch.nn.attention.flex_attention import create_block_mask

    allowed = mask[:, 0, 0, :]
    return create_block_mask(lambda b, h, q_idx, kv_idx: allowed[b, kv_idx], mask.shape[0], None, 1,
                             mask.shape[-1], device=str(mask.device))


def attention_triton(q, k, v, mask):
    from eagle3_pipeline.verifier.triton_decode import triton_decode_attention

    return triton_decode_attention(q, k, v, mask)


def attention_flex(q, k, v, mask):
    return compiled_flex_attention()(q, k, v, block_mask=block_mask(mask), enable_gqa=True)


WAYS = {"repeat": attention_repeat, "gqa": attention_gqa, "folded": attention_folded, "matmul": attention_matmul,
        "reduce": attention_reduce, "triton": attention_triton, "flex": attention_flex}


def timed_function(way: str, compile_: bool):
    """The way's function, compiled with static shapes when asked (flex compiles itself)."""
    if not compile_ or way == "flex":
        return WAYS[way]
    return torch.compile(WAYS[way], dynamic=False)


def inputs(rows: int, width: int, heads: int, kv_heads: int, dim: int, device, dtype, generator):
    q = torch.randn(rows, heads, 1, dim, device=device, dtype=dtype, generator=generator)
    k = torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype, generator=generator)
    v = torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype, generator=generator)
    # Left padding of up to half the width, and the unwritten tail of the cache hidden too.
    pads = torch.randint(0, width // 2, (rows,), device=device, generator=generator)
    filled = width - width // 4
    columns = torch.arange(width, device=device)
    mask = (columns[None] >= pads[:, None]) & (columns[None] < filled)
    return q, k, v, mask[:, None, None, :]


def time_call(fn, args, iters: int, device) -> float:
    """Seconds per call (CUDA events on a GPU, wall clock elsewhere)."""
    for _ in range(3):
        fn(*args)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / iters
    import time
    began = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - began) / iters


def main(argv=None) -> list[dict]:
    """Prints the table; returns its rows."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1024x384,624x512,180x1280", help="rows x cache width, comma-separated")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="layers a decoding step runs (SmolLM2-135M: 30)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s, for the bound (H200: 4,800)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="time each way compiled, as the loop engine runs it")
    p.add_argument("--triton-sweep", action="store_true",
                   help="also time the Triton kernel at each combination of its options (rows 'triton b.. ...')")
    p.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ",".join(WAYS)
                   + " (repeat, the reference, always runs first)")
    args = p.parse_args(argv)
    ways = ["repeat"] + [way for way in args.ways.split(",") if way != "repeat"]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# Decoding attention, one layer, {name}, {args.dtype}, heads {args.heads}/{args.kv_heads}x{args.head_dim};"
          f" ms a step = one layer x {args.layers}{', compiled' if args.compile else ''}\n")
    print("| rows x width | way | us a call | ms a step | vs repeat | max abs diff | K/V read bound, ms a step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    results = []
    with torch.inference_mode(), sdpa_without_cudnn():
        for shape in args.shapes.split(","):
            rows, width = (int(x) for x in shape.split("x"))
            q, k, v, mask = inputs(rows, width, args.heads, args.kv_heads, args.head_dim, device, dtype, generator)
            reference = attention_repeat(q, k, v, mask).float()
            bound = 2 * k.numel() * k.element_size() / (args.bandwidth * 1e9) * args.layers * 1e3
            base = None
            timed = [(way, timed_function(way, args.compile)) for way in ways]
            for name, fn in timed + (list(triton_variants(args.head_dim)) if args.triton_sweep else []):
                seconds = time_call(fn, (q, k, v, mask), args.iters, device)
                base = base or seconds
                diff = (fn(q, k, v, mask).float() - reference).abs().max().item()
                print(f"| {rows}x{width} | {name} | {seconds * 1e6:.1f} | {seconds * args.layers * 1e3:.2f} | "
                      f"{base / seconds:.2f}x | {diff:.1e} | {bound:.2f} |", flush=True)
                results.append({"shape": shape, "way": name, "seconds": seconds, "max_abs_diff": diff})
    return results


def triton_variants(dim: int):
    """(name, function) for each combination of the Triton kernel's options."""
    from eagle3_pipeline.verifier.triton_decode import launch

    for block, skip, warps, stages in itertools.product((32, 64, 128), (True, False), (2, 4, 8), (None, 2, 3)):
        name = f"triton b{block} {'skip' if skip else 'masked'} w{warps} s{stages or '-'}"
        yield name, functools.partial(launch, scale=dim ** -0.5, block=block, skip=skip, num_warps=warps,
                                      num_stages=stages)


if __name__ == "__main__":
    main()
