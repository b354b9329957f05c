#!/usr/bin/env python3
"""Benchmark one full EAGLE-3 drafter training step: tokens/s, peak GPU memory, MFU.

The timed step is stage 04's own: eagle3_pipeline.train.step.train_step (ttt_loss from eagle3_pipeline.train.loss +
backward + grad clip + optimizer step + scheduler), with the optimizer stage 04 builds
(eagle3_pipeline.train.optimizer.make_optimizer) unless --optimizer says otherwise. Inputs are synthetic and already on
the device: aux [B,S,3H] and final [B,S,H] hidden states (bf16), random input ids, all-ones masks, a random verifier
lm_head [V,H], and a vocabulary map of the Vd most frequent verifier-argmax tokens of the batch (as stage 03 builds it
from real data; it keeps nearly every position in the loss, like real data does).

Shapes (drafter = one Llama layer at the verifier's width; peer numbers are SpecForge 0.2.0 on one H200):
  smollm2  H 576,  9 heads, 3 KV, intermediate 1536,  V 49152
  llama8b  H 4096, 32 heads, 8 KV, intermediate 14336, V 128256
  kimi     H 7168, 56 heads, 8 KV, intermediate 40960, V 163840
Draft vocabulary 32000, TTT 7, batch 1.

MFU = model FLOPs / (step time * 989e12), model FLOPs counted as the peer benchmark counts them
(6 * trainable params * tokens * TTT + causal attention + TTT diagonal terms; see step_flops), so the
numbers compare directly; mfu_fc_once removes the fc over-count (fc runs once per step, not per TTT step).

Usage (H200):
  python scripts/lab/bench_train_step.py --device cuda --shapes smollm2,llama8b,kimi --seq-lens 2048,8192
  python scripts/lab/bench_train_step.py --device cuda --shapes kimi --seq-lens 2048 --optimizer sr
CPU smoke test (numbers mean nothing; bf16 matmuls are very slow on most CPUs):
  python scripts/lab/bench_train_step.py --device cpu --dtype fp32 --shapes tiny --seq-lens 64 --steps 2 --warmup 1

Each (shape, length) runs in its own subprocess, so an OOM or a crash is recorded and the next one starts
clean. stdout carries only JSON lines; they are also appended to $OUT/bench_train_step.jsonl when OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback


H200_PEAK_BF16_FLOPS = 989e12
RESULT_FILE = "bench_train_step.jsonl"
RESULT_MARKER = "BENCH_TRAIN_STEP_RESULT "

SHAPES = {
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                    vocab_size=49152),
    "llama8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                    vocab_size=128256),
    "kimi": dict(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, intermediate_size=40960,
                 vocab_size=163840),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 vocab_size=1024),
}
PEER = {  # SpecForge 0.2.0 on one H200: (tokens/s, peak GiB)
    ("smollm2", 2048): (26600, 2.9), ("llama8b", 2048): (16200, 13.1), ("llama8b", 8192): (21800, 28.1),
    ("kimi", 2048): (6400, 39.3), ("kimi", 8192): (8100, 59.2),
}


def log(message: str) -> None:
    print(f"[bench_train_step] {message}", file=sys.stderr, flush=True)


def step_flops(cfg, batch: int, seq: int, ttt: int, trainable: int) -> dict:
    """Model FLOPs of one step (forward + backward), the peer benchmark's convention."""
    nh, hd = cfg.num_attention_heads, cfg.head_dim
    tokens = batch * seq
    dense = 6 * trainable * tokens * ttt
    attention = ttt * 6 * batch * nh * hd * seq * seq + 12 * batch * nh * hd * seq * (ttt * (ttt - 1) // 2)
    fc = cfg.hidden_size * cfg.fc_in_features
    return {"flops_per_step": dense + attention, "flops_fc_once": dense + attention - 6 * fc * tokens * (ttt - 1),
            "teacher_head_flops": 2 * tokens * cfg.hidden_size * cfg.vocab_size}


def synthetic_vocab_map(torch, final, lm_head, draft_vocab: int, seed: int):
    """d2t/t2d of the Vd most frequent verifier-argmax tokens of this batch (ties/remainder at random)."""
    V = lm_head.shape[0]
    with torch.no_grad():
        rows = final.reshape(-1, final.shape[-1])
        argmax = torch.cat([(rows[i:i + 1024] @ lm_head.t()).argmax(-1) for i in range(0, rows.shape[0], 1024)])
        counts = torch.bincount(argmax.cpu(), minlength=V).float()
    gen = torch.Generator().manual_seed(seed)
    selected = torch.topk(counts + 0.5 * torch.rand(V, generator=gen), draft_vocab).indices.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    coverage = float(t2d[argmax.cpu()].float().mean())
    return selected - torch.arange(draft_vocab), t2d, coverage


def memory_estimate_gib(cfg, trainable: int, seq: int, ttt: int, master: bool, offload: bool, mlp: str,
                        ce_stored: bool = False) -> dict:
    """Rough model of the peak (bf16 params/grads, fp32 moments): what to expect before running."""
    gib = 1 / 2 ** 30
    H, inter = cfg.hidden_size, cfg.intermediate_size
    fixed = trainable * (2 + 2 + 8 + (4 if master else 0))
    frozen = cfg.vocab_size * H * 2 * (1 if offload else 2)  # verifier lm_head (+ embedding on the GPU)
    per_step = seq * 2 * (8 * H + {"none": 3, "act": 2, "gate_up": 0}[mlp] * inter  # tensors kept per TTT step
                          + (cfg.draft_vocab_size if ce_stored else 0))  # the soft-CE's logits gradient
    other = seq * 2 * (cfg.draft_vocab_size + 8 * H)
    return {"fixed_gib": round((fixed + frozen) * gib, 2), "activations_gib": round((per_step * ttt + other) * gib, 2),
            "total_gib": round((fixed + frozen + per_step * ttt + other + seq * 2 * inter * 4) * gib, 2)}


def run_one(args) -> dict:
    import torch

    from eagle3_pipeline.model import drafter as D
    from eagle3_pipeline.model.config import DrafterConfig
    from eagle3_pipeline.model.kernels import fuse_elementwise
    from eagle3_pipeline.train import optimizer as O
    from eagle3_pipeline.train.loss import store_ce_gradients, ttt_loss

    rec = {"bench": "bench_train_step", "shape": args.shape, "seq_len": args.seq_len, "batch_size": args.batch_size,
           "ttt_steps": args.ttt_steps, "draft_vocab_size": args.draft_vocab, "device": args.device,
           "dtype": args.dtype, "status": "error"}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    shape = dict(SHAPES[args.shape])
    if args.shape_json:
        shape.update(json.loads(args.shape_json))
    H, V = shape["hidden_size"], shape["vocab_size"]
    if args.draft_vocab >= V:  # tiny smoke-test shapes: keep a real (non-identity) map
        args.draft_vocab = V // 2
    cfg = DrafterConfig(
        hidden_size=H, num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=H // shape["num_attention_heads"],
        intermediate_size=shape["intermediate_size"], rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=max(8192, args.seq_len + 64), vocab_size=V, draft_vocab_size=args.draft_vocab,
        aux_layers=[2, 30, 58])
    rec["drafter_config"] = dataclasses.asdict(cfg)
    rec["draft_vocab_size"] = args.draft_vocab
    B, S, T = args.batch_size, args.seq_len, args.ttt_steps
    rec.update(torch_version=torch.__version__)
    if device.type == "cuda":
        rec.update(gpu_name=torch.cuda.get_device_name(device), cuda_version=torch.version.cuda)
    t_setup = time.perf_counter()

    # ---- inputs and the frozen verifier head, directly on the device
    gen = torch.Generator(device=device).manual_seed(args.seed)
    lm_head = (torch.randn(V, H, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
    batch = {
        "input_ids": torch.randint(0, V, (B, S), generator=gen, device=device),
        "loss_mask": torch.ones(B, S, dtype=torch.long, device=device),
        "attention_mask": torch.ones(B, S, dtype=torch.long, device=device),
        "aux": torch.randn(B, S, 3 * H, generator=gen, device=device, dtype=torch.float32).to(dtype),
        "final": torch.randn(B, S, H, generator=gen, device=device, dtype=torch.float32).to(dtype),
    }
    d2t, t2d, coverage = synthetic_vocab_map(torch, batch["final"], lm_head, args.draft_vocab, args.seed)
    rec["position_mask_coverage"] = round(coverage, 5)

    # ---- the drafter, built on the device
    with torch.device(device):
        model = D.Eagle3Drafter(cfg)
    model = model.to(dtype)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.02)
        model.set_vocab_mapping(d2t.to(device), t2d.to(device))
        model.lm_head.weight.copy_(lm_head.index_select(0, model.draft_token_ids()))
    offload = args.offload_embedding == "on" or (args.offload_embedding == "auto" and device.type == "cuda"
                                                 and V * H * 2 >= (1 << 28))
    if offload:
        model.offload_embedding()
    mlp = args.mlp_recompute
    model.set_memory_policy(mlp, ce_grad=args.ce_grad)
    if args.fp8:
        model.use_fp8()
    trainable = O.trainable_parameter_count(model)
    rec.update(params_trainable=trainable, embedding_offloaded=offload, mlp_recompute=mlp, ce_grad=args.ce_grad,
               gemms="fp8 (e4m3/e5m2, per-tensor scales)" if args.fp8 else "bf16",
               fused_elementwise=fuse_elementwise(),
               ce_grad_stored=store_ce_gradients(cfg, args.ce_grad))

    # ---- optimizer + scheduler + step: stage 04's
    try:
        from eagle3_pipeline.train import step as TR
        from eagle3_pipeline.train.step import TrainConfig, train_step
    except ImportError:  # stage 04 not present: the same steps inline
        TR = None
    # stage04: master weights when the parameters are narrower than fp32, as stage 04 builds it
    master_weights = None if args.optimizer == "stage04" else args.optimizer == "master"
    optimizer = O.make_optimizer(model, args.lr, master_weights=master_weights)
    master = bool(getattr(optimizer, "master_weights", False))
    rec["optimizer"] = (f"{type(optimizer).__name__}(master_weights={master}, "
                        f"stochastic_rounding={getattr(optimizer, 'stochastic_rounding', None) and not master})")
    rec["optimizer_source"] = "eagle3_pipeline.train.optimizer.make_optimizer" if args.optimizer == "stage04" else \
        f"eagle3_pipeline.train.optimizer.make_optimizer({args.optimizer})"
    rec["memory_model"] = memory_estimate_gib(cfg, trainable, B * S, T, master, offload, mlp,
                                              rec["ce_grad_stored"])
    if TR is not None:
        scheduler = O.make_scheduler(optimizer, total_steps=100_000, warmup_ratio=0.015, kind="cosine")
        train_cfg = TrainConfig(lr=args.lr, max_grad_norm=0.5, ttt_steps=T, ttt_decay=0.8,
                                device=str(device), dtype=str(dtype).replace("torch.", ""), fp8=args.fp8)

        def step():
            return train_step(model, batch, optimizer, scheduler, lm_head, train_cfg)["loss"]
        rec["code_path"] = "eagle3_pipeline.train.step.train_step (ttt_loss + backward + clip + optimizer + scheduler)"
    else:
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            loss, _ = ttt_loss(model, batch, lm_head, T)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()
        rec["code_path"] = "inline: ttt_loss + backward + clip_grad_norm_ + optimizer.step"
    rec["setup_s"] = round(time.perf_counter() - t_setup, 2)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    losses = []
    sync()
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(float(step()))
    sync()
    rec["warmup_s"] = round(time.perf_counter() - t0, 2)
    if device.type == "cuda":
        rec["peak_mem_warmup_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 3)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        sync()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            h0 = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - h0) * 1e3)
        losses.append(float(loss))
    if args.profile:
        write_profile(torch, step, args, sync, device.type == "cuda")
    if args.count_ops:
        rec["aten_ops_per_step"] = count_ops(step)
    med = statistics.median(times)
    rec["timer"] = "cuda_events" if device.type == "cuda" else "host_perf_counter"
    rec["step_time_ms_median"] = round(med, 3)
    rec["step_times_ms"] = [round(t, 2) for t in times]
    rec["tokens_per_step"] = B * S
    rec["tokens_per_s"] = round(B * S / (med / 1e3), 1)
    flops = step_flops(cfg, B, S, T, trainable)
    rec.update(flops)
    if device.type == "cuda":
        rec["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
        rec["peak_mem_gib"] = round(rec["peak_mem_bytes"] / 2 ** 30, 3)
        rec["peak_mem_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2 ** 30, 3)
        rec["mfu"] = round(flops["flops_per_step"] / (med / 1e3) / H200_PEAK_BF16_FLOPS, 4)
        rec["mfu_fc_once"] = round(flops["flops_fc_once"] / (med / 1e3) / H200_PEAK_BF16_FLOPS, 4)
    peer = PEER.get((args.shape, S)) if B == 1 and T == 7 and args.draft_vocab == 32000 else None
    if peer is not None:
        rec["peer_specforge"] = {"tokens_per_s": peer[0], "peak_mem_gib": peer[1]}
        rec["speedup_vs_peer"] = round(rec["tokens_per_s"] / peer[0], 3)
        if "peak_mem_gib" in rec:
            rec["memory_vs_peer"] = round(rec["peak_mem_gib"] / peer[1], 3)
            rec["meets_target"] = rec["speedup_vs_peer"] >= 1.3 and rec["memory_vs_peer"] <= 0.7
    from eagle3_pipeline.model.ttt_attention import _BACKEND_CACHE
    rec["ttt_attention_backend"] = os.environ.get("EAGLE3_TTT_ATTENTION") or sorted(set(_BACKEND_CACHE.values())) or None
    rec["loss_first"], rec["loss_last"] = losses[0], losses[-1]
    rec["status"] = "ok" if all(x == x and abs(x) != float("inf") for x in losses) else "nonfinite_loss"
    return rec


def write_profile(torch, step, args, sync, cuda: bool) -> None:
    """Where a step's time goes: torch.profiler's tables for 3 steps (by op, then by op and input shapes, which
    finds the large copies and casts), to $OUT/profile_SHAPE_SEQ.txt, or stderr. GPU time on a GPU, else CPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    sync()
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(3):
            step()
        sync()
    tables = [prof.key_averages().table(sort_by=sort_by, row_limit=45, max_name_column_width=70),
              prof.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=45,
                                                                  max_name_column_width=40, max_shapes_column_width=90)]
    text = "\n\n".join(tables)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"profile_{args.shape}_{args.seq_len}.txt"), "w") as handle:
            handle.write(text)
    else:
        log(text)


def count_ops(step) -> int:
    """ATen operations one step dispatches (views included): what a host-bound step's time scales with, and the
    same on any device, so a change in the host's work shows on a CPU too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        step()
    return Counter.count


def run_guarded(args) -> dict:
    try:
        return run_one(args)
    except BaseException as exc:  # noqa: BLE001 - OOM and crashes become the result
        if isinstance(exc, KeyboardInterrupt):
            raise
        msg = f"{type(exc).__name__}: {exc}"
        rec = {"bench": "bench_train_step", "shape": args.shape, "seq_len": args.seq_len,
               "status": "oom" if "out of memory" in msg.lower() else "error", "error": msg[:3000],
               "traceback_tail": traceback.format_exc()[-4000:]}
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rec["peak_mem_gib_at_failure"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
        except Exception:  # noqa: BLE001
            pass
        return rec
    finally:
        gc.collect()


def emit(rec: dict) -> None:
    line = json.dumps(rec, default=str)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, RESULT_FILE), "a") as handle:
            handle.write(line + "\n")


def child_argv(args, shape: str, seq_len: int) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--_child", "--shapes", shape, "--seq-lens", str(seq_len)]
    for name in ("batch_size", "ttt_steps", "draft_vocab", "steps", "warmup", "device", "dtype", "optimizer",
                 "mlp_recompute", "ce_grad", "offload_embedding", "ttt_attention", "lr", "seed"):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.shape_json:
        argv += ["--shape-json", args.shape_json]
    if args.profile:
        argv.append("--profile")
    if args.count_ops:
        argv.append("--count-ops")
    if args.fp8:
        argv.append("--fp8")
    return argv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", default="smollm2,llama8b,kimi", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--seq-lens", default="2048,8192")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--optimizer", choices=("stage04", "sr", "master"), default="stage04",
                   help="stage04: eagle3_pipeline.train.optimizer.make_optimizer (what stage 04 uses); sr: bf16 "
                        "parameters with stochastic rounding, no master copy; master: fp32 master weights")
    p.add_argument("--mlp-recompute", choices=("act", "gate_up", "none"), default="act",
                   help="act: keep gate/up outputs, recompute silu*up; gate_up: keep only the MLP input")
    p.add_argument("--ce-grad", choices=("auto", "store", "recompute"), default="auto",
                   help="soft-CE: keep the logits' gradient [S, Vd] per TTT step until backward (store) or "
                        "recompute it there (recompute); auto: store for large drafters (eagle3_pipeline.train.loss."
                        "store_ce_gradients)")
    p.add_argument("--offload-embedding", choices=("auto", "on", "off"), default="auto",
                   help="keep the frozen [V,H] embedding in pinned CPU memory (auto: on CUDA when >= 256 MiB)")
    p.add_argument("--ttt-attention", default="auto",
                   choices=("auto", "flash_cuda", "efficient_cuda", "cudnn_cuda", "math"),
                   help="causal kernel of the TTT attention (auto: the drafter's own choice; the others force "
                        "EAGLE3_TTT_ATTENTION, e.g. to compare cudnn_cuda with flash_cuda)")
    p.add_argument("--fuse-elementwise", action="store_true",
                   help="the TTT step's elementwise ops as compiled islands (EAGLE3_FUSE_ELEMENTWISE=1, a candidate)")
    p.add_argument("--fp8", action="store_true",
                   help="stage 04's --fp8: the drafter's GEMMs on FP8 tensor cores "
                        "(eagle3_pipeline.model.kernels.Fp8Gemms)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape-json", default=None, help="JSON overrides of the shape, e.g. for a CPU smoke test")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per configuration (subprocess)")
    p.add_argument("--in-process", action="store_true", help="run configurations in this process")
    p.add_argument("--profile", action="store_true",
                   help="also write torch.profiler's kernel table of 3 steps to $OUT/profile_SHAPE_SEQ.txt")
    p.add_argument("--count-ops", action="store_true",
                   help="also count the ATen operations of one step (aten_ops_per_step): the host's work")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    seq_lens = [int(x) for x in args.seq_lens.split(",") if x]
    if args.ttt_attention != "auto":  # read by eagle3_pipeline.model.ttt_attention at every TTT attention call
        os.environ["EAGLE3_TTT_ATTENTION"] = args.ttt_attention
    if args.fuse_elementwise:  # read by eagle3_pipeline.model at every TTT unroll (children inherit it)
        os.environ["EAGLE3_FUSE_ELEMENTWISE"] = "1"
    if args._child:
        args.shape, args.seq_len = shapes[0], seq_lens[0]
        print(RESULT_MARKER + json.dumps(run_guarded(args), default=str), flush=True)
        return 0
    ok = True
    for shape in shapes:
        for seq_len in seq_lens:
            if args.in_process:
                args.shape, args.seq_len = shape, seq_len
                rec = run_guarded(args)
            else:
                log(f"{shape} S={seq_len}")
                proc = subprocess.Popen(child_argv(args, shape, seq_len), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
                try:
                    out, err = proc.communicate(timeout=args.timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    out, err = proc.communicate()
                    timed_out = True
                rec = None
                for line in (out or "").splitlines():
                    if line.startswith(RESULT_MARKER):
                        rec = json.loads(line[len(RESULT_MARKER):])
                if err:
                    sys.stderr.write(err[-4000:])
                if rec is None:
                    rec = {"bench": "bench_train_step", "shape": shape, "seq_len": seq_len,
                           "status": "timeout" if timed_out else "crashed", "returncode": proc.returncode,
                           "stderr_tail": (err or "")[-3000:]}
                    if "out of memory" in (err or "").lower():
                        rec["status"] = "oom"
            ok &= rec.get("status") == "ok"
            emit(rec)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
