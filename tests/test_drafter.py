"""The EAGLE-3 drafter (eagle3_pipeline/model with its checkpoint.py, eagle3_pipeline/train/loss.py and optimizer.py,
eagle3_pipeline/formats/checkpoint.py and layer_ids.py): TTT attention and loss against naive full-mask references, the
decode path, the SGLang export and its checker, the optimizer, and a conversion by the `speculators` package.

Models are tiny random configurations built in code (fp64 where two implementations are compared, so any
difference is a bug, not rounding), plus the real stories260K for the export/conversion tests.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3_pipeline.formats import checkpoint as CK
from eagle3_pipeline.model.checkpoint import check_drafter_dir, inspect_drafter_dir, load_drafter, save_drafter
from eagle3_pipeline.formats.layer_ids import aux_layers_from_eagle_config, eagle_config_layer_ids
from eagle3_pipeline.model import config as C
from eagle3_pipeline.model import drafter as D
from eagle3_pipeline.model import ttt_attention as TA
from eagle3_pipeline.model.config import DrafterConfig
from eagle3_pipeline.model.drafter import DrafterCache, Eagle3Drafter
from eagle3_pipeline.model.ttt_attention import ttt_attention
from eagle3_pipeline.train import loss as L
from eagle3_pipeline.train import optimizer as O
from eagle3_pipeline.train.loss import simulated_acceptance_length, ttt_loss
from eagle3_pipeline.train.optimizer import make_optimizer

V, VD, H = 40, 16, 16


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                  rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
                  vocab_size=V, draft_vocab_size=VD, aux_layers=[1, 3, 5])
    values.update(overrides)
    return DrafterConfig(**values)


def vocab_map(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=gen)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(VD), t2d


def tiny_model(seed: int = 0, dtype=torch.float64, **overrides) -> tuple[Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(seed)
    model = Eagle3Drafter(tiny_config(**overrides)).to(dtype)
    with torch.no_grad():  # norms away from 1 so their gradients matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    lm_head = torch.randn(V, H, dtype=dtype)
    d2t, t2d = vocab_map(seed)
    model.init_from_verifier(torch.randn(V, H, dtype=dtype), lm_head, d2t, t2d)
    return model, lm_head


def random_batch(B: int, S: int, dtype=torch.float64, seed: int = 1, pad: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    attention = torch.ones(B, S)
    if pad:
        attention[-1, S - pad:] = 0
    loss_mask = (torch.rand(B, S, generator=gen) > 0.3).float() * attention
    ids = torch.randint(0, V, (B, S), generator=gen) * attention.long()
    return dict(input_ids=ids, loss_mask=loss_mask, attention_mask=attention,
                aux=torch.randn(B, S, 3 * H, generator=gen, dtype=dtype),
                final=torch.randn(B, S, H, generator=gen, dtype=dtype))


# --- naive references: the full (S, S*(j+1)) mask and full-vocabulary logits ----------------------------

def naive_ttt_attention(q, k0, v0, diag, scale):
    """q [B,S,nh,D]; k0/v0 [B,S,nh,D]; diag [k1, v1, ...] [B,S,nkv,D] -> concatenated keys + explicit mask."""
    S, nh = q.shape[1], q.shape[2]
    rep = nh // diag[0].shape[2]
    keys = torch.cat([k0] + [TA.expand_heads(k, rep) for k in diag[0::2]], dim=1)
    values = torch.cat([v0] + [TA.expand_heads(v, rep) for v in diag[1::2]], dim=1)
    steps = len(diag) // 2
    mask = torch.zeros(S, S * (steps + 1), dtype=torch.bool)
    mask[:, :S] = torch.ones(S, S, dtype=torch.bool).tril()
    for i in range(1, steps + 1):
        mask[:, i * S:(i + 1) * S] = torch.eye(S, dtype=torch.bool)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def naive_ttt_loss(model: Eagle3Drafter, batch: dict, lm_head: torch.Tensor, steps: int, decay: float,
                   positions: str = "shifted", objective: str = "kl"):
    """The TTT loss written out plainly: full-vocabulary logits, per-row loops for the masks; objective "lk":
    -log sum_v min(p_v, q_v) per row instead of the soft-CE."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    ids, aux, final = batch["input_ids"], batch["aux"], batch["final"]
    B, S = ids.shape
    full = final @ lm_head.t()
    draft_ids = model.draft_token_ids()
    target_p = torch.softmax(full[..., draft_ids], dim=-1)
    target_arg = full[..., draft_ids].argmax(-1)
    in_draft = model.t2d[full.argmax(-1)]
    emb = layer.input_layernorm(model.embed(ids))
    emb = torch.cat([emb, torch.zeros(B, steps, H, dtype=emb.dtype)], dim=1)
    rep = attn.num_heads // attn.num_kv_heads
    hidden = model.fuse(aux)
    keys = []
    loss = 0.0
    sums, correct, counts = [], [], []
    for j in range(steps):
        a = torch.cat([emb[:, j + 1:j + 1 + S], layer.hidden_norm(hidden)], dim=-1)
        # row t of step j is the j-th draft step after t, which decoding runs at position t+j ("fixed": t)
        q, k, v = attn.qkv(a, *model.rope(torch.arange(S)[None] + (j if positions == "shifted" else 0)))
        if j == 0:
            k0, v0 = TA.expand_heads(k, rep), TA.expand_heads(v, rep)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2),
                                                 is_causal=True).transpose(1, 2)
        else:
            keys += [k, v]
            out = naive_ttt_attention(q, k0, v0, keys, attn.head_dim ** -0.5)
        hidden = model._after_attention(hidden, out.reshape(B, S, -1))
        logp = torch.log_softmax(model.logits(hidden), dim=-1)
        step_sum, step_correct, step_count = 0.0, 0, 0
        for b in range(B):
            for t in range(S):
                u = t + 1 + j  # the verifier position whose distribution is the target
                if u + 1 >= S or not batch["loss_mask"][b, u + 1] or not batch["attention_mask"][b, u + 1] \
                        or not in_draft[b, u]:
                    continue
                if objective == "kl":
                    step_sum = step_sum - (target_p[b, u] * logp[b, t]).sum()
                else:
                    step_sum = step_sum - torch.minimum(target_p[b, u], logp[b, t].exp()).sum().log()
                step_correct += int(logp[b, t].argmax() == target_arg[b, u])
                step_count += 1
        loss = loss + decay ** j * step_sum / max(step_count, 1)
        sums.append(float(step_sum.detach()) if torch.is_tensor(step_sum) else step_sum), correct.append(step_correct), counts.append(step_count)
    return loss, {"loss_sum": sums, "correct": correct, "count": counts}


# --- layer ids ---------------------------------------------------------------------------------------

def test_layer_id_convention_is_sglang_minus_one_and_round_trips():
    assert eagle_config_layer_ids([2, 30, 58]) == [1, 29, 57]  # SpecForge's DeepSeek-V3 ids
    assert aux_layers_from_eagle_config(eagle_config_layer_ids([3, 31, 59])) == [3, 31, 59]
    config = tiny_config(aux_layers=[2, 30, 58], vocab_size=163840).to_sglang_config()
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]  # SGLang reads this
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # vLLM reads this first
    assert DrafterConfig.from_sglang_config(config).aux_layers == [2, 30, 58]


def test_deepseek_family_verifiers_follow_sglangs_own_layer_id_rule():
    """SGLang's deepseek_v2.py shifts the ids only when the first is 1 (Kimi-K2.5 is of that family)."""
    kimi = "KimiK25ForConditionalGeneration"
    assert eagle_config_layer_ids([2, 30, 58], kimi) == [1, 29, 57]  # the published Kimi drafters' ids
    assert eagle_config_layer_ids([3, 31, 59], kimi) == [3, 31, 59]  # taken as written there
    assert eagle_config_layer_ids([3, 31, 59], "LlamaForCausalLM") == [2, 30, 58]
    for layers in ([2, 30, 58], [3, 31, 59], [4, 20, 50]):
        assert aux_layers_from_eagle_config(eagle_config_layer_ids(layers, kimi), kimi) == layers
    with pytest.raises(ValueError, match="cannot capture the input of layer 1"):
        eagle_config_layer_ids([1, 30, 58], kimi)
    # The exported config names the verifier's architecture, so reading it back gives the trained layers.
    cfg = tiny_config(aux_layers=[3, 31, 59], vocab_size=163840, verifier_architecture=kimi)
    config = cfg.to_sglang_config()
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    config["eagle3_pipeline"] = {"verifier_architecture": kimi}
    assert DrafterConfig.from_sglang_config(config).aux_layers == [3, 31, 59]


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_acceptance_length([1.0, 0.0, 1.0]) == 2.0


# --- TTT attention -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("backend", ["math", "flash_cpu"])
@pytest.mark.parametrize("steps,nkv", [(1, 2), (2, 6), (4, 2), (3, 1)])
def test_ttt_attention_matches_full_mask_reference(backend, steps, nkv, fused, monkeypatch):
    """Both diagonal-term implementations: batched matmuls (default) and EAGLE3_FUSE_ELEMENTWISE's."""
    monkeypatch.setenv("EAGLE3_FUSE_ELEMENTWISE", fused)
    gen = torch.Generator().manual_seed(steps)
    B, S, nh, Dh = 2, 11, 6, 8

    def rand(heads):
        return torch.randn(B, S, heads, Dh, generator=gen, dtype=torch.float64).requires_grad_()

    q, k0, v0 = rand(nh), rand(nkv), rand(nkv)
    diag = [rand(nkv) for _ in range(2 * steps)]
    inputs = [q, k0, v0, *diag]
    weight = torch.randn(B, S, nh, Dh, generator=gen, dtype=torch.float64)
    k0e, v0e = TA.expand_heads(k0, nh // nkv), TA.expand_heads(v0, nh // nkv)
    out = ttt_attention(q, k0e, v0e, diag, Dh ** -0.5, backend=backend)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref = naive_ttt_attention(q, k0e, v0e, diag, Dh ** -0.5)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_ttt_attention_memory_is_linear_in_sequence_length():
    """The math backend's blocks and the diagonal terms never build a (S, S*(j+1)) tensor per step: peak
    extra memory of a long sequence stays far below one such mask."""
    B, S, nh, Dh = 1, 4096, 2, 8
    q = torch.randn(B, S, nh, Dh)
    kv = [torch.randn(B, S, 1, Dh) for _ in range(6)]
    block = TA._math_block(B, nh, S)
    assert block * S * nh * 4 <= (1 << 26)  # one score block <= 64 MB whatever S is
    out = ttt_attention(q, TA.expand_heads(kv[0], 2), TA.expand_heads(kv[1], 2), kv[2:], Dh ** -0.5,
                        backend="math")
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("policy", ["act", "gate_up"])
def test_mlp_recompute_policies_match_plain_autograd(policy):
    """The naive loss reference runs the same MLP, so the memory-saving backward is checked on its own."""
    torch.manual_seed(0)
    mlp = D.DrafterMLP(H, 24).double()
    x = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 5, H, dtype=torch.float64)
    params = [x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    mlp.recompute = "none"
    want = torch.autograd.grad((mlp(x) * weight).sum(), params)
    mlp.recompute = policy
    got = torch.autograd.grad((mlp(x) * weight).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_compiled_elementwise_pieces_equal_their_eager_functions():
    """On CUDA the soft-CE and SwiGLU elementwise passes run through torch.compile (they overwrite an input
    in place); compiled here on the CPU, they must give what the eager functions give."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    n, width = 6, 40
    lg = torch.randn(n, width, generator=gen)
    p = torch.softmax(torch.randn(n, width, generator=gen), dim=-1)
    argmax, row_w = p.argmax(-1), (torch.rand(n, generator=gen) > 0.3).float()
    gate, up, grad_act = (torch.randn(n, width, generator=gen) for _ in range(3))
    cases = [(L._soft_ce_rows, (lg, p, argmax, row_w, True), 0),
             (L._soft_ce_grad_rows, (lg, p, torch.logsumexp(lg, -1), row_w), 0),
             (L._log_acceptance_rows, (lg, p, argmax, row_w, True), 0),
             (L._log_acceptance_grad_of_logits, (lg, p, torch.logsumexp(lg, -1), row_w), None),
             (D._silu_mul, (gate, up), None),
             (D._swiglu_grads_, (gate, up, grad_act), 2)]
    for fn, args, mutated in cases:
        eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        compiled_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = fn(*eager_args)
        got = torch.compile(fn, dynamic=True, fullgraph=True)(*compiled_args)
        for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            torch.testing.assert_close(a, b)
        if mutated is not None:
            torch.testing.assert_close(compiled_args[mutated], eager_args[mutated])
            assert not torch.equal(eager_args[mutated], args[mutated])  # the function did overwrite it
    # Training passes the soft-CE a whole batch at once: [batch, positions, Vd] views of the [batch, S, Vd]
    # logits, whose gradient is written in place, through the strides, into the logits' own memory.
    B, S, T = 3, 7, 5
    logits = torch.randn(B, S, width, generator=gen)
    p3 = torch.softmax(torch.randn(B, T, width, generator=gen), dim=-1)
    argmax3, row_w3 = p3.argmax(-1), (torch.rand(B, T, generator=gen) > 0.3).float()
    for fn, extra in ((L._soft_ce_rows, (argmax3, row_w3, True)),
                      (L._soft_ce_grad_rows, (torch.logsumexp(logits[:, :T], -1), row_w3))):
        bases = {name: logits.clone() for name in ("rows", "eager", "compiled")}
        per_row = [fn(bases["rows"][b, :T], p3[b], *[e[b] if isinstance(e, torch.Tensor) else e for e in extra])
                   for b in range(B)]
        eager = fn(bases["eager"][:, :T], p3, *extra)
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)(bases["compiled"][:, :T], p3, *extra)
        for got in (eager, compiled):
            if isinstance(got, tuple):
                for k, part in enumerate(got):
                    torch.testing.assert_close(part, torch.stack([row[k] for row in per_row]))
        torch.testing.assert_close(bases["eager"], bases["rows"])
        torch.testing.assert_close(bases["compiled"], bases["rows"])
        assert torch.equal(bases["rows"][:, T:], logits[:, T:]) and not torch.equal(bases["rows"], logits)


# --- the TTT loss --------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,ce_grad,positions,objective", [
    ("math", "store", "shifted", "kl"), ("flash_cpu", "store", "shifted", "kl"), ("math", "recompute", "shifted", "kl"),
    ("flash_cpu", "store", "fixed", "kl"), ("math", "store", "shifted", "lk"), ("math", "recompute", "shifted", "lk")])
def test_ttt_loss_matches_naive_reference_values_grads_and_metrics(backend, ce_grad, positions, objective,
                                                                   monkeypatch):
    """positions "fixed" is stage 04's --ttt-positions fixed (the earlier training, kept for an A/B); objective
    "lk" is --loss lk, whose hand-written gradient must equal autograd's through the plain formula."""
    monkeypatch.setenv("EAGLE3_TTT_ATTENTION", backend)
    model, lm_head = tiny_model()
    model.set_memory_policy("act", ce_grad=ce_grad)
    model.ttt_positions = positions
    batch = random_batch(B=2, S=10, pad=3)
    steps, decay = 4, 0.8
    loss, metrics = ttt_loss(model, batch, lm_head, steps, decay=decay, objective=objective)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    ref, ref_metrics = naive_ttt_loss(model, batch, lm_head, steps, decay, positions, objective)
    if objective == "lk":  # a different objective: the reference can tell the two apart
        kl, _ = naive_ttt_loss(model, batch, lm_head, steps, decay, positions, "kl")
        assert abs(float(kl) - float(ref)) > 1e-3
    other, _ = naive_ttt_loss(model, batch, lm_head, steps, decay, "fixed" if positions == "shifted" else "shifted")
    assert abs(float(other) - float(ref)) > 1e-6  # the positions matter: the comparison can tell them apart
    ref_grads = torch.autograd.grad(ref, [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    assert metrics["count"].tolist() == ref_metrics["count"]
    assert metrics["correct"].tolist() == ref_metrics["correct"]
    torch.testing.assert_close(metrics["loss_sum"].double(), torch.tensor(ref_metrics["loss_sum"],
                               dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert sum(ref_metrics["count"]) > 10  # the comparison is not vacuous


def test_ttt_loss_counts_only_in_vocab_loss_masked_real_tokens():
    """Verifier argmax chosen per position through a one-hot lm_head; the count is checked by hand."""
    model, _ = tiny_model()
    B, S, steps = 2, 12, 3
    lm_head = torch.zeros(V, H, dtype=torch.float64)
    lm_head[torch.arange(H), torch.arange(H)] = 1.0  # logit of token i = final[..., i] for i < H
    draft = model.draft_token_ids()
    outside = [i for i in range(H) if i not in set(draft.tolist())]
    inside = [i for i in draft.tolist() if i < H]
    gen = torch.Generator().manual_seed(3)
    argmax = torch.tensor([[inside[i % len(inside)] if (i * 7 + b) % 3 else outside[i % len(outside)]
                            for i in range(S)] for b in range(B)])
    final = torch.rand(B, S, H, generator=gen, dtype=torch.float64)
    final.scatter_(2, argmax[..., None], 5.0)
    batch = random_batch(B, S, seed=4, pad=2)
    batch["final"] = final
    _, metrics = ttt_loss(model, batch, lm_head, steps)
    expected = []
    for j in range(steps):
        n = 0
        for b in range(B):
            for t in range(S - 2 - j):
                label = t + 2 + j
                n += int(batch["loss_mask"][b, label] == 1 and batch["attention_mask"][b, label] == 1
                         and argmax[b, label - 1].item() in set(draft.tolist()))
        expected.append(n)
    assert metrics["count"].tolist() == expected
    assert 0 < expected[0] < B * (S - 2)


def test_fused_elementwise_islands_give_the_same_loss_and_gradients(monkeypatch):
    """EAGLE3_FUSE_ELEMENTWISE=1 regroups the TTT step's elementwise ops into compiled islands; here (CPU,
    eager) the same maths must give the same loss and gradients."""
    results, island_calls = [], []
    real = D._ATTENTION_INPUT
    monkeypatch.setattr(D, "_ATTENTION_INPUT", lambda *args: island_calls.append(1) or real(*args))
    for flag in ("0", "1"):
        monkeypatch.setenv("EAGLE3_FUSE_ELEMENTWISE", flag)
        model, lm_head = tiny_model()
        loss, _ = ttt_loss(model, random_batch(B=2, S=12, pad=2), lm_head, 3)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss0, grads0), (loss1, grads1) = results
    assert len(island_calls) == 3  # one per TTT step, and only with the flag
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=0)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile's CPU backend (Inductor) needs a C++ compiler, and none is installed")
def test_fused_elementwise_islands_compile_with_autograd():
    """The islands and the fused TTT diagonal terms through torch.compile (Inductor's CPU backend here, Triton on GPUs): values and
    gradients equal the eager functions'."""
    gen = torch.Generator().manual_seed(0)
    B, S, H, nh, nkv, Dh = 1, 24, 16, 4, 2, 8

    def leaves(*shapes):
        return [torch.randn(*shape, generator=gen, dtype=torch.float32).requires_grad_() for shape in shapes]

    cos, sin = torch.randn(1, S, 1, Dh, generator=gen), torch.randn(1, S, 1, Dh, generator=gen)
    cases = [(D._attention_input, leaves((B, S, H), (H,), (B, S, H), (H,)) + [1e-5]),
             (D._rope_qk, leaves((B, S, nh, Dh), (B, S, nkv, Dh)) + [cos, sin]),
             (D._residual_norm, leaves((B, S, H), (B, S, H), (H,)) + [1e-5]),
             (TA._diag_merge, leaves((B, S, nh, Dh), (B, S, nkv, 3, Dh), (B, S, nkv, 3, Dh), (B, nh, S, Dh))
              + [torch.randn(B, nh, S, generator=gen), Dh ** -0.5]),
             (TA._diag_grads, leaves((B, S, nh, Dh), (B, S, nh, Dh), (B, S, nkv, 3, Dh), (B, S, nkv, 3, Dh),
                                    (B, S, nh, Dh))
              + [torch.randn(B, S, nh, generator=gen), torch.randn(B, nh, S, Dh, generator=gen), Dh ** -0.5])]
    for fn, args in cases:
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        outs = {}
        for name, f in (("eager", fn), ("compiled", compiled)):
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    a.grad = None
            out = f(*args)
            out = out if isinstance(out, tuple) else (out,)
            sum(o.square().sum() for o in out).backward()
            outs[name] = [o.detach() for o in out] + [a.grad.clone() for a in args
                                                      if isinstance(a, torch.Tensor) and a.requires_grad]
        for got, expected in zip(outs["compiled"], outs["eager"]):
            # fp32 with reordered reductions: close relative to the tensor's scale (second-order gradients
            # of _diag_grads reach 1e5)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, expected.abs().max().item()),
                                       msg=fn.__name__)


def test_target_distribution_chunked_equals_full_vocabulary():
    model, lm_head = tiny_model()
    final = torch.randn(2, 9, H, dtype=torch.float64)
    small = L.target_distribution(final, lm_head, model.draft_token_ids(), model.t2d, budget_elems=7)
    full = final @ lm_head.t()
    torch.testing.assert_close(small["probs"], torch.softmax(full[..., model.draft_token_ids()], dim=-1))
    assert torch.equal(small["in_draft"], model.t2d[full.argmax(-1)])
    assert torch.equal(small["argmax"], full[..., model.draft_token_ids()].argmax(-1))


def assert_overfits_a_fixed_batch(model: Eagle3Drafter, lm_head: torch.Tensor) -> None:
    """60 steps on one batch: the loss halves and every TTT step agrees with the verifier on > 80%."""
    batch = random_batch(B=2, S=16, dtype=torch.float32, pad=2)
    optimizer = make_optimizer(model, lr=1e-2)
    losses = []
    for _ in range(60):
        loss, metrics = ttt_loss(model, batch, lm_head.float(), 3, noise_std=0.01)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.5)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    acc = (metrics["correct"] / metrics["count"]).tolist()
    assert min(acc) > 0.8, acc


def test_loss_decreases_when_overfitting_a_fixed_batch():
    assert_overfits_a_fixed_batch(*tiny_model(dtype=torch.float32))


def test_bf16_training_step_runs_and_embedding_stays_frozen():
    model, lm_head = tiny_model(dtype=torch.float32)
    model = model.to(torch.bfloat16)
    embed_before = model.embed_tokens.weight.clone()
    batch = random_batch(B=1, S=12, dtype=torch.bfloat16)
    optimizer = make_optimizer(model, lr=1e-3, master_weights=False)  # stochastic rounding, no master copy
    before = model.fc.weight.detach().clone()
    loss, _ = ttt_loss(model, batch, lm_head.to(torch.bfloat16), 2)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert not torch.equal(before, model.fc.weight)
    assert torch.equal(embed_before, model.embed_tokens.weight)
    assert optimizer.state[model.fc.weight]["exp_avg"].dtype == torch.float32


class SdpaBackendsSeen(torch.overrides.TorchFunctionMode):
    """Records, at every F.scaled_dot_product_attention call, whether PyTorch may pick cuDNN's kernel."""

    def __init__(self):
        super().__init__()
        self.cudnn_allowed: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("opt_out", [False, True])
def test_training_attention_never_lets_pytorch_pick_cudnn(opt_out, monkeypatch):
    # On an H200 cuDNN's SDPA built a graph for every new sequence length: 150 of a 197 ms training step.
    if opt_out:
        monkeypatch.setenv("EAGLE3_CUDNN_ATTENTION", "1")
    model, lm_head = tiny_model(dtype=torch.float32)
    seen = SdpaBackendsSeen()
    with seen:
        loss, _ = ttt_loss(model, random_batch(B=2, S=12), lm_head, 3)
        loss.backward()
    assert seen.cudnn_allowed, "the TTT forward made no SDPA call: the check saw nothing"
    assert all(allowed == opt_out for allowed in seen.cudnn_allowed)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process-wide choice is restored afterwards


def test_stochastic_rounding_keeps_updates_smaller_than_half_a_bf16_ulp():
    """100 steps of +2e-4 on a weight of 1.0 (bf16 ulp 2^-7): round-to-nearest never moves; stochastic
    rounding tracks the fp32 sum in expectation."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(20000, dtype=torch.bfloat16))
    x = p.detach().float() + 0.1
    rounded = O._stochastic_round_bf16(x)
    assert abs(rounded.float().mean().item() - 1.1) < 2e-3  # unbiased
    assert set(torch.unique(rounded.float()).tolist()) <= {1.09375, 1.1015625}  # neighbours only
    results = {}
    for mode in ("nearest", "stochastic", "master"):
        q = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = O.DrafterAdamW([q], lr=2e-4, master_weights=mode == "master",
                             stochastic_rounding=mode == "stochastic")
        for _ in range(100):
            q.grad = -torch.ones_like(q)  # Adam step of exactly lr per iteration
            opt.step()
        results[mode] = q.float().mean().item()
        if mode == "master":
            assert opt.state[q]["master"].mean().item() == pytest.approx(1.02, abs=1e-5)
    assert results["nearest"] == 1.0  # every update rounded away
    assert results["stochastic"] == pytest.approx(1.02, abs=1e-3)
    assert results["master"] == pytest.approx(1.02, abs=2 ** -8)  # nearest bf16 of the fp32 master


# --- decode ------------------------------------------------------------------------------------------

def test_decode_with_cache_equals_full_sequence_and_ttt_step0_and_crop_rolls_back():
    model, lm_head = tiny_model()
    batch = random_batch(B=2, S=9)
    ids, aux = batch["input_ids"], batch["aux"]
    S = ids.shape[1]
    T = S - 1
    positions = torch.arange(T)[None].expand(2, T)
    hidden = model.fuse(aux[:, :T])
    with torch.no_grad():
        full, full_logits = model.decode(ids[:, 1:], hidden, positions)
        step0 = next(model.ttt_hidden_states(ids, aux, 1))[1]
        torch.testing.assert_close(full, step0[:, :T])
        cache = DrafterCache()
        outs = [model.decode(ids[:, t + 1:t + 2], hidden[:, t:t + 1], positions[:, t:t + 1], cache)
                for t in range(T)]
        torch.testing.assert_close(torch.cat([o[0] for o in outs], 1), full)
        torch.testing.assert_close(torch.cat([o[1] for o in outs], 1), full_logits)
        assert cache.length == T
        cache.crop(4)
        again, _ = model.decode(ids[:, 5:], hidden[:, 4:], positions[:, 4:], cache)
        torch.testing.assert_close(again, full[:, 4:])
        # an explicit tree mask equal to the causal one gives the same result
        tree = DrafterCache()
        model.decode(ids[:, 1:4], hidden[:, :3], positions[:, :3], tree)
        mask = torch.ones(2, 1, T - 3, T, dtype=torch.bool).tril(diagonal=3)
        masked, _ = model.decode(ids[:, 4:], hidden[:, 3:], positions[:, 3:], tree, attention_mask=mask)
        torch.testing.assert_close(masked, full[:, 3:])
    assert torch.equal(model.draft_to_target(torch.arange(VD)), model.draft_token_ids())


def test_ttt_step_j_is_the_speculative_decoders_jth_draft_step(stories260k):
    """Training matches decoding: row t of TTT step j is the j-th draft step after position t, which the
    speculative decoder (as SGLang's draft steps) runs at RoPE position t+j. Every chain step of a real decode
    (stories260K verifier, float64) is replayed as training on the committed text followed by the drafted
    tokens, so the unroll teacher-forces exactly what the decoder drafted: step j's logits at the root's row
    must equal the decoder's j-th draft logits. (Training that keeps position t at every step fails this.)"""
    from eagle3_pipeline.bench.speculative import SpeculativeDecoder
    from eagle3_pipeline.verifier.capture import LayerInputCapture, decoder_layers, whole
    from eagle3_pipeline.verifier.loading import load_tokenizer, load_verifier_model

    verifier = load_verifier_model(str(stories260k), "cpu", "float64")
    prompt = load_tokenizer(str(stories260k))("Once upon a time").input_ids
    drafter = stories260k_drafter(stories260k)[0].double().eval()
    k = 4
    decoder = SpeculativeDecoder(verifier, drafter, num_steps=k)
    chains: list[tuple[int, list]] = []  # per chain step: committed, [(token fed, logits)] of its draft forwards
    drafting = []  # non-empty inside a chain step (the other drafter calls are extends)
    chain_step, draft_forward = decoder._chain_step, decoder._draft_forward

    def recording_chain_step(root, h_last, z_last, committed, *rest):
        chains.append((committed, []))
        drafting.append(True)
        try:
            return chain_step(root, h_last, z_last, committed, *rest)
        finally:
            drafting.clear()

    def recording_draft_forward(token_ids, hidden, positions, cache, mask=None):
        out, logits = draft_forward(token_ids, hidden, positions, cache, mask)
        if drafting:
            chains[-1][1].append((int(token_ids[0, -1]), logits[0, -1]))
        return out, logits

    decoder._chain_step, decoder._draft_forward = recording_chain_step, recording_draft_forward
    out, stats = decoder.generate(prompt, 24, [])
    assert len(chains) == stats.verify_steps >= 6
    n = len(prompt)
    for committed, steps in chains:
        assert len(steps) == k - 1
        # the root (last committed token) is at committed-1; the row before it starts the chain
        sequence = torch.tensor([prompt + out[:committed - n] + [token for token, _ in steps]])
        with torch.no_grad(), LayerInputCapture(decoder_layers(verifier), drafter.config.aux_layers,
                                                select=whole) as capture:
            verifier.model(sequence)
            unroll = drafter.ttt_hidden_states(sequence, capture.take_concatenated(), k)
            trained = [drafter.logits(prenorm)[0, committed - 2] for _, prenorm in unroll]
        for j, (_, decoded) in enumerate(steps, start=1):
            torch.testing.assert_close(trained[j], decoded, rtol=1e-9, atol=1e-9,
                                       msg=lambda m: f"TTT step {j}, root at {committed - 1}: {m}")


# --- export / load / check ----------------------------------------------------------------------------

EXPECTED_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def test_export_has_exact_keys_shapes_dtypes_and_config(tmp_path):
    from safetensors.torch import load_file

    model, _ = tiny_model(dtype=torch.float32)
    model = model.to(torch.bfloat16)
    save_drafter(model, tmp_path / "d", extra={"step": 5})
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert set(tensors) == EXPECTED_KEYS
    cfg = model.config
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * H)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * H)
    assert tensors["midlayer.mlp.down_proj.weight"].shape == (H, 24)
    assert tensors["lm_head.weight"].shape == (VD, H)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (VD,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,)
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k not in ("d2t", "t2d"))
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == V and config["draft_vocab_size"] == VD and config["hidden_size"] == H
    assert config["eagle_config"] == {"use_aux_hidden_state": True,
                                      "eagle_aux_hidden_state_layer_ids": eagle_config_layer_ids(cfg.aux_layers)}
    assert config["eagle_aux_hidden_state_layer_ids"] == cfg.aux_layers
    assert not set(CK.FORBIDDEN_CONFIG_KEYS) & set(config)
    assert config[CK.METADATA_KEY]["step"] == 5
    assert check_drafter_dir(tmp_path / "d", {"aux_layers": cfg.aux_layers}) == []
    assert not list(tmp_path.glob(".d.*"))  # no staging folder left behind


def test_save_load_round_trip_gives_the_same_drafter(tmp_path):
    model, _ = tiny_model(dtype=torch.float32)
    save_drafter(model, tmp_path / "d")
    save_drafter(model, tmp_path / "d")  # overwriting an existing checkpoint is atomic too
    loaded = load_drafter(tmp_path / "d", embed=model.embed_tokens.weight.detach())
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    batch = random_batch(B=1, S=6, dtype=torch.float32)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        want = model.decode(batch["input_ids"][:, 1:], model.fuse(batch["aux"][:, :5]), pos)[1]
        got = loaded.decode(batch["input_ids"][:, 1:], loaded.fuse(batch["aux"][:, :5]), pos)[1]
    torch.testing.assert_close(got, want)


def _plant(folder: Path, tensors_fn=None, config_fn=None):
    from safetensors.torch import load_file, save_file

    if tensors_fn is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        tensors_fn(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    if config_fn is not None:
        config = json.loads((folder / "config.json").read_text())
        config_fn(config)
        (folder / "config.json").write_text(json.dumps(config))


def _rename(tensors, old, new):
    tensors[new] = tensors.pop(old)


def _break_d2t(tensors):
    d2t = tensors["d2t"].clone()
    ids = torch.arange(len(d2t)) + d2t
    d2t[3] = ids[4] - 3  # draft ids 3 and 4 now name the same token
    tensors["d2t"] = d2t


def _move_t2d(tensors):
    t2d = tensors["t2d"].clone()
    ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    t2d[ids[3]] = False
    t2d[int(torch.nonzero(~t2d)[0])] = True  # same count, but draft id 3's token is no longer marked
    tensors["t2d"] = t2d


PLANTED = {
    "renamed key": (lambda t: _rename(t, "midlayer.hidden_norm.weight", "midlayer.hidden_norm.weights"), None,
                    ["missing tensor 'midlayer.hidden_norm.weight'", "unexpected tensor 'midlayer.hidden_norm.weights'"]),
    "wrong shape": (lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:-1].clone()), None,
                    ["lm_head.weight has shape"]),
    "wrong dtype": (lambda t: t.__setitem__("d2t", t["d2t"].int()), None, ["d2t has dtype I32"]),
    "d2t duplicate id": (_break_d2t, None, ["not strictly ascending"]),
    "t2d disagrees with d2t": (_move_t2d, None, ["1 draft ids arange(Vd)+d2t are not marked in t2d"]),
    "missing architectures": (None, lambda c: c.pop("architectures"), ["architectures is None"]),
    "eagle-3.1 flag": (None, lambda c: c.__setitem__("norm_before_fc", True), ["norm_before_fc"]),
    "embed in config missing": (None, lambda c: c.pop("draft_vocab_size"), ["missing draft_vocab_size"]),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_check_drafter_dir_finds_planted_problems(tmp_path, case):
    model, _ = tiny_model(dtype=torch.float32)
    save_drafter(model, tmp_path / "d")
    tensors_fn, config_fn, expected = PLANTED[case]
    _plant(tmp_path / "d", tensors_fn, config_fn)
    problems = check_drafter_dir(tmp_path / "d", {"aux_layers": model.config.aux_layers})
    for text in expected:
        assert any(text in p for p in problems), (text, problems)


def test_check_drafter_dir_compares_layer_ids_with_the_hidden_state_manifest(tmp_path):
    model, _ = tiny_model(dtype=torch.float32)  # trained on HF layers [1, 3, 5]
    save_drafter(model, tmp_path / "d")
    assert check_drafter_dir(tmp_path / "d", {"aux_layers": [1, 3, 5]}) == []
    problems = check_drafter_dir(tmp_path / "d", {"aux_layers": [2, 3, 5]})
    assert any("SGLang will capture the inputs of layers [1, 3, 5]" in p and "[1, 2, 4]" in p for p in problems)
    # ids written as if SGLang took them as layer inputs (the classic off-by-one)
    _plant(tmp_path / "d", config_fn=lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids",
                                                                             [1, 3, 5]))
    problems = check_drafter_dir(tmp_path / "d", {"aux_layers": [1, 3, 5]})
    assert any("[2, 4, 6]" in p for p in problems), problems
    # vLLM's top-level ids dropped: SGLang is still right, vLLM would not be -> a warning, not a problem
    _plant(tmp_path / "d", config_fn=lambda c: (c["eagle_config"].__setitem__(
        "eagle_aux_hidden_state_layer_ids", [0, 2, 4]), c.pop("eagle_aux_hidden_state_layer_ids")))
    problems, notes = inspect_drafter_dir(tmp_path / "d", {"aux_layers": [1, 3, 5]})
    assert problems == [] and any("vLLM would capture" in n for n in notes)


def stories260k_drafter(stories260k, **overrides):
    """A drafter on stories260K's shape, initialised from its real tensors, with draft ids 0, 2, ..., 198."""
    from eagle3_pipeline.formats.layer_ids import default_aux_layers
    from eagle3_pipeline.verifier.loading import read_embedding_tensors, read_verifier_info

    info = read_verifier_info(str(stories260k))
    cfg = DrafterConfig.from_verifier(info, 100, default_aux_layers(info.num_layers), **overrides)
    model = Eagle3Drafter(cfg)
    tensors = read_embedding_tensors(str(stories260k))
    ids = torch.arange(0, 200, 2)
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[ids] = True
    model.init_from_verifier(tensors["embed_tokens"].float(), tensors["lm_head"].float(), ids - torch.arange(100), t2d)
    return model, tensors, ids, t2d


def test_from_verifier_and_init_on_real_stories260k(stories260k):
    model, tensors, ids, t2d = stories260k_drafter(stories260k, intermediate_size=96)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 8, 4, 8)
    assert cfg.intermediate_size == 96 and cfg.vocab_size == 512
    assert torch.equal(model.lm_head.weight, tensors["lm_head"].float()[ids])
    assert not model.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="not marked in t2d"):
        bad = t2d.clone()
        bad[0] = False
        bad[1] = True
        model.init_from_verifier(tensors["embed_tokens"].float(), tensors["lm_head"].float(),
                                 ids - torch.arange(100), bad)
    from eagle3_pipeline.verifier.loading import read_verifier_info

    info = read_verifier_info(str(stories260k))
    mla = type(info)(**{**info.__dict__, "model_type": "deepseek_v3", "hidden_size": 7168,
                        "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 112,
                        "vocab_size": 163840, "rope_scaling": {"type": "yarn", "factor": 32.0, "mscale": 1.0}})
    kimi = DrafterConfig.from_verifier(mla, 32000, [2, 30, 58])
    assert (kimi.head_dim, kimi.rope_scaling) == (128, None)
    assert C.parse_drafter_overrides('{"num_key_value_heads": 8}') == {"num_key_value_heads": 8}
    with pytest.raises(ValueError, match="unknown field"):
        C.parse_drafter_overrides('{"heads": 8}')


def test_rope_scaling_types():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    inv, scale = C.rope_parameters(tiny_config(rope_scaling=llama3))
    base, _ = C.rope_parameters(tiny_config())
    assert inv.shape == base.shape and not torch.equal(inv, base) and scale == 1.0
    inv, _ = C.rope_parameters(tiny_config(rope_scaling={"type": "linear", "factor": 2.0}))
    torch.testing.assert_close(inv, base / 2)
    with pytest.raises(ValueError, match="not supported"):
        tiny_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})


def test_speculators_converter_accepts_the_export(tmp_path, stories260k):
    """vLLM's `speculators` package converts and validates the export (Eagle3Converter with validate=True).

    speculators 0.9.0 imports openai, loguru, pydantic_settings and hs_connectors at import time and pins
    transformers<=5.19; it runs here when installed with `pip install --no-deps speculators loguru
    pydantic-settings openai httpx anyio distro jiter sniffio httpcore h11 python-dotenv hs-connectors`.
    """
    try:
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    except Exception as err:  # noqa: BLE001 - any import failure means: not runnable here
        pytest.skip(f"speculators not importable here ({type(err).__name__}: {err}); see the docstring")
    from safetensors.torch import load_file

    model, _, _, _ = stories260k_drafter(stories260k)
    cfg = model.config
    save_drafter(model.to(torch.bfloat16), tmp_path / "ours")
    Eagle3Converter().convert(tmp_path / "ours", tmp_path / "converted", base_model=str(stories260k),
                              validate=True, eagle_aux_hidden_state_layer_ids=cfg.aux_layers)
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    for key, value in ours.items():
        new_key = key.replace("midlayer.", "layers.0.")
        assert torch.equal(converted[new_key], value), key
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["draft_vocab_size"] == 100
    assert config["eagle_aux_hidden_state_layer_ids"] == cfg.aux_layers


def test_check_drafter_script_and_bench_smoke(tmp_path, monkeypatch):
    """scripts/check_drafter.py on a valid and a broken folder; scripts/lab/bench_train_step.py on a tiny shape."""
    import importlib.util

    from conftest import REPO, run_script

    model, _ = tiny_model(dtype=torch.float32)
    save_drafter(model, tmp_path / "d")
    (tmp_path / "hs").mkdir()
    (tmp_path / "hs" / "manifest.json").write_text(json.dumps({"aux_layers": model.config.aux_layers}))
    done = run_script("scripts/check_drafter.py", str(tmp_path / "d"), "--data-dir", str(tmp_path / "hs"))
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
    (tmp_path / "hs" / "manifest.json").write_text(json.dumps({"aux_layers": [0, 3, 5]}))
    done = run_script("scripts/check_drafter.py", str(tmp_path / "d"), "--data-dir", str(tmp_path / "hs"))
    assert done.returncode == 1 and "SGLang will capture" in done.stdout

    spec = importlib.util.spec_from_file_location("bench_train_step", REPO / "scripts" / "lab" / "bench_train_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    code = bench.main(["--device", "cpu", "--dtype", "fp32", "--shapes", "tiny", "--seq-lens", "32",
                       "--ttt-steps", "2", "--steps", "1", "--warmup", "1", "--in-process", "--optimizer", "sr"])
    rec = json.loads((tmp_path / "out" / "bench_train_step.jsonl").read_text().splitlines()[-1])
    assert code == 0 and rec["status"] == "ok", rec
    assert rec["tokens_per_s"] > 0 and rec["flops_per_step"] > 0 and rec["ttt_attention_backend"]

    # The host's work per step (ATen operations) does not grow with the number of sequences in a batch:
    # 8 sequences of 32 tokens cost the same operations as one of 256 (a small drafter's GPU step is bound by it).
    ops = {}
    for batch_size, seq_len in ((1, 256), (8, 32)):
        bench.main(["--device", "cpu", "--dtype", "fp32", "--shapes", "tiny", "--seq-lens", str(seq_len),
                    "--batch-size", str(batch_size), "--ttt-steps", "2", "--steps", "1", "--warmup", "1",
                    "--in-process", "--optimizer", "sr", "--count-ops"])
        rec = json.loads((tmp_path / "out" / "bench_train_step.jsonl").read_text().splitlines()[-1])
        ops[batch_size] = rec["aten_ops_per_step"]
    assert ops[1] > 500 and ops[8] == ops[1], ops


def test_offloaded_embedding_stays_put_and_short_sequences_still_backpropagate():
    model, lm_head = tiny_model()
    model.offload_embedding()
    model = model.to(torch.float32)
    assert model.embed_tokens.weight.dtype == torch.float64  # the offloaded table is left alone
    assert model.fc.weight.dtype == torch.float32
    batch = random_batch(B=1, S=2, dtype=torch.float32)
    loss, metrics = ttt_loss(model, batch, lm_head.float(), 3)
    loss.backward()  # no label at all, yet a graph to run backward on
    assert metrics["count"].sum() == 0 and model.fc.weight.grad is not None
