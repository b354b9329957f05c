"""Speculative decoding with an EAGLE-3 drafter and a Hugging Face verifier (batch size 1): chain and tree.

How one iteration drafts, verifies, accepts and rolls back: docs/benchmarking.md ("The offline decoding loop").
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from eagle3_pipeline.bench.decoding import GenerationStats, append_until_stop, as_input_ids, synchronize
from eagle3_pipeline.bench.sampling import Sampler, make_generator, rejection_sample
from eagle3_pipeline.bench.verifier_runner import VerifierRunner
from eagle3_pipeline.verifier.capture import LayerInputCapture, decoder_layers, whole
from eagle3_pipeline.model.kernels import sdpa_without_cudnn


def resolve_draft_shape(num_steps: int, topk: int, num_draft_tokens: int | None) -> int:
    """Tokens verified per step including the last committed one (SGLang's --speculative-num-draft-tokens).

    Chain (topk 1): num_steps + 1. Tree: at most 1 + topk + (num_steps - 1) * topk^2 candidates exist;
    the default is 1 + topk * num_steps.
    """
    if num_steps < 1 or topk < 1:
        raise ValueError(f"num_steps and topk must be >= 1 (got {num_steps}, {topk})")
    if topk == 1:
        if num_draft_tokens not in (None, num_steps + 1):
            raise ValueError(f"chain drafting (topk 1) verifies num_steps + 1 = {num_steps + 1} tokens; "
                             f"num_draft_tokens {num_draft_tokens} does not fit (leave it unset or use topk > 1)")
        return num_steps + 1
    most = 1 + topk + (num_steps - 1) * topk * topk
    if num_draft_tokens is None:
        return min(1 + topk * num_steps, most)
    if not 2 <= num_draft_tokens <= most:
        raise ValueError(f"num_draft_tokens {num_draft_tokens} must lie in 2..{most} for num_steps {num_steps} "
                         f"and topk {topk} (root + at most {most - 1} candidates)")
    return num_draft_tokens


# --- the speculative decoder -----------------------------------------------------------------------------

class SpeculativeDecoder:
    """EAGLE-3 speculative decoding: `generate(input_ids, max_new_tokens, eos_token_ids) -> (tokens, stats)`.

    `verifier`: a transformers causal LM (SDPA attention for trees). `drafter`:
    eagle3_pipeline.model.drafter.Eagle3Drafter on the same device. num_steps: draft depth; topk: branches per step
    (1 = chain); num_draft_tokens: tokens verified per step including the last committed one (tree only;
    chain = num_steps + 1).
    """

    def __init__(self, verifier: torch.nn.Module, drafter: torch.nn.Module, num_steps: int = 3, topk: int = 1,
                 num_draft_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, aux_layers: Sequence[int] | None = None, explicit_mask: bool = True,
                 acceptance_rule: str = "rejection"):
        from eagle3_pipeline.model.drafter import DrafterCache

        self.verifier = VerifierRunner(verifier)
        self.explicit_mask = explicit_mask
        self.drafter = drafter
        self.cache_type = DrafterCache
        self.num_steps, self.topk = num_steps, topk
        self.num_draft_tokens = resolve_draft_shape(num_steps, topk, num_draft_tokens)
        self.device = self.verifier.device
        self.generator = make_generator(self.device, seed) if temperature > 0 else None
        self.sampler = Sampler(temperature, top_p, self.generator)
        if acceptance_rule not in ("rejection", "target-only"):
            raise ValueError(f"acceptance_rule must be rejection or target-only, got {acceptance_rule!r}")
        if acceptance_rule == "target-only" and topk > 1:
            raise ValueError("acceptance_rule target-only is a chain's rule (topk 1), as in SGLang")
        self.target_only = acceptance_rule == "target-only"
        config = getattr(drafter, "config", None) or drafter.cfg
        self.aux_layers = list(aux_layers if aux_layers is not None else config.aux_layers)
        if len(self.aux_layers) != 3:
            raise ValueError(f"the drafter names {len(self.aux_layers)} aux layers ({self.aux_layers}); EAGLE-3 "
                             f"needs three (give aux_layers explicitly for a drafter config without them)")
        self.layers = decoder_layers(verifier)
        bad = [i for i in self.aux_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"aux layers {bad} outside the verifier's {len(self.layers)} decoder layers")
        # A weight the drafter computes with (its frozen embedding may be offloaded to the CPU).
        param = next((p for p in drafter.parameters() if p.requires_grad), None)
        param = param if param is not None else next(drafter.parameters())
        if param.device != self.device:
            raise ValueError(f"drafter on {param.device}, verifier on {self.device}: put both on one device")
        self.drafter_dtype = getattr(drafter, "compute_dtype", param.dtype)
        vd = int(config.draft_vocab_size)
        # Target id of every draft id, once: drafting then maps ids with one gather and no host work.
        self.draft_to_target = drafter.draft_to_target(torch.arange(vd, device=self.device)).to(torch.long)
        self.tree = topk > 1
        if self.tree:
            self.verifier.tree_mask(torch.ones(1, 1, dtype=torch.bool, device=self.device), torch.float32)

    @property
    def drafting(self) -> str:
        if self.tree:
            return f"tree (num_steps {self.num_steps}, topk {self.topk}, num_draft_tokens {self.num_draft_tokens})"
        return f"chain (num_steps {self.num_steps})"

    # --- drafter calls ---------------------------------------------------------------------------------
    def _draft_forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.decode(token_ids, hidden, positions, cache, attention_mask=mask)

    def _extend(self, token_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, cache, stats):
        """Drafter entries for committed tokens paired with the verifier's fused aux states; returns the
        last pre-norm output and draft logits (the source of the next first draft)."""
        hidden = self.drafter.fuse(aux.to(self.drafter_dtype))
        out, logits = self._draft_forward(token_ids, hidden, positions, cache)
        stats.drafter_forwards += 1
        return out[:, -1:], logits[:, -1]

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream from `seed` (stage 05 does it per turn, so a turn's sample is the same
        whichever turns a process decoded before it). No effect at temperature 0."""
        if self.generator is not None:
            self.generator.manual_seed(seed)

    # --- the loop ------------------------------------------------------------------------------------
    @torch.inference_mode()
    @sdpa_without_cudnn()
    def generate(self, input_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = ()
                 ) -> tuple[list[int], GenerationStats]:
        ids = as_input_ids(input_ids, self.device)
        n = ids.shape[1]
        eos = set(eos_token_ids or ())
        stats = GenerationStats(prompt_tokens=n, num_positions=self.num_steps)
        # Position ids as views of one tensor: slicing it costs no host-to-device copy inside the loop.
        positions = torch.arange(n + max_new_tokens + self.num_steps + 2, device=self.device).unsqueeze(0)
        tokens: list[int] = []
        synchronize(self.device)
        started = time.perf_counter()
        vcache, dcache = self.verifier.new_cache(), self.cache_type()
        with LayerInputCapture(self.layers, self.aux_layers, select=whole) as capture:
            logits = self.verifier(ids, vcache, last_only=True)
            stats.verifier_forwards += 1
            first = self.sampler.pick(logits[:, -1])  # [1]
            # Drafter prefill: pairs (x_{t+1}, g_t) for t = 0 .. n-1, the last pairing the first new token.
            draft_in = torch.cat([ids[:, 1:], first.view(1, 1)], dim=1)
            h_last, z_last = self._extend(draft_in, capture.take_concatenated(), positions[:, :n], dcache, stats)
            finished = append_until_stop(tokens, [int(first.item())], max_new_tokens, eos, stats)
            root, committed = first.view(1, 1), n + 1  # root: last committed token, not yet in the verifier cache
            while not finished:
                step = self._tree_step if self.tree else self._chain_step
                new, ext_tokens, ext_aux = step(root, h_last, z_last, committed, vcache, dcache, capture,
                                                positions, stats)
                stats.verifier_forwards += 1
                stats.accept_lengths.append(len(new))
                finished = append_until_stop(tokens, new, max_new_tokens, eos, stats)
                if finished:
                    break
                accepted = len(new)
                # Drafter rollback: drop the draft-step entries, re-enter the accepted tokens with the
                # verifier's own states for them.
                dcache.crop(committed - 1)
                h_last, z_last = self._extend(ext_tokens, ext_aux,
                                              positions[:, committed - 1:committed - 1 + accepted], dcache, stats)
                root = ext_tokens[:, -1:]
                committed += accepted
        synchronize(self.device)
        stats.wall_s = time.perf_counter() - started
        stats.new_tokens = len(tokens)
        return tokens, stats

    # --- chain -----------------------------------------------------------------------------------------
    def _chain_step(self, root, h_last, z_last, committed, vcache, dcache, capture, positions, stats):
        k, greedy = self.num_steps, self.sampler.greedy
        draft_ids, q_rows = [], []
        hidden, z = h_last, z_last
        for j in range(k):
            if greedy:
                draft_id = z.argmax(dim=-1)  # [1]
            elif self.target_only:
                # SGLang's default: the top draft token, as if the drafter were certain of it. With q one-hot,
                # rejection sampling accepts it with probability p(token) and resamples from p without it.
                draft_id = z.argmax(dim=-1)
                q_rows.append(torch.nn.functional.one_hot(draft_id[0], z.shape[-1]).float())
            else:
                q = self.sampler.probs(z)  # [1, Vd]
                draft_id = self.sampler.draw(q)
                q_rows.append(q[0])
            draft_ids.append(draft_id)
            if j < k - 1:
                # Position committed-1+j pairs the token just drafted with the drafter's own last output
                # (root row t = committed-2, draft step j+1 at t+j+1: the positions of TTT step j+1).
                token = self.draft_to_target[draft_id].view(1, 1)
                hidden, logits = self._draft_forward(token, hidden, positions[:, committed - 1 + j:committed + j],
                                                     dcache)
                stats.drafter_forwards += 1
                z = logits[:, -1]
        draft_ids = torch.cat(draft_ids)  # [k] draft-vocabulary ids
        drafts = self.draft_to_target[draft_ids]  # [k] verifier ids
        verify_in = torch.cat([root.view(1), drafts]).view(1, k + 1)
        mask = self.verifier.causal_mask(committed - 1, k + 1, self.verifier.dtype) if self.explicit_mask else None
        logits = self.verifier(verify_in, vcache, attention_mask=mask)[0]  # [k+1, V]
        aux = capture.take_concatenated()
        if greedy:
            target = logits.argmax(dim=-1)  # [k+1]
            accepted = (target[:k] == drafts).int().cumprod(0).sum()
            packed = torch.cat([accepted.view(1), target]).tolist()  # the one sync of this iteration
            a = packed[0]
            new = packed[1:a + 2]
            ext_tokens = target[:a + 1]
        else:
            accepted, fallback = rejection_sample(self.sampler.probs(logits), torch.stack(q_rows), draft_ids,
                                                  self.draft_to_target, self.sampler)
            packed = torch.cat([accepted.view(1), drafts, fallback]).tolist()
            a = packed[0]
            new = packed[1:1 + a] + [packed[1 + k + a]]
            ext_tokens = torch.cat([drafts[:a], fallback[a:a + 1]])
        self.verifier.crop(vcache, committed + a)
        return new, ext_tokens.view(1, a + 1), aux[:, :a + 1]

    # --- tree ------------------------------------------------------------------------------------------
    def _tree_step(self, root, h_last, z_last, committed, vcache, dcache, capture, positions, stats):
        K, S, D = self.topk, self.num_steps, self.num_draft_tokens
        device, base = self.device, committed - 1
        eye = torch.eye(K, dtype=torch.bool, device=device)
        rows = torch.arange(K, device=device)

        # Depth 1: the topk children of the last committed token.
        log_probs = torch.log_softmax(z_last[0].float(), dim=-1)
        score, draft_id = log_probs.topk(K)
        cand_tokens, cand_scores = [self.draft_to_target[draft_id]], [score]
        cand_parents = [torch.full((K,), -1, device=device, dtype=torch.long)]
        cand_depths = [torch.ones(K, device=device, dtype=torch.long)]
        expanded_tokens, expanded_scores, expanded_index = cand_tokens[0], score, rows
        expanded_hidden = h_last.expand(1, K, h_last.shape[-1])
        ancestors = torch.zeros(K, 0, dtype=torch.bool, device=device)  # over earlier draft-step entries
        offset = K
        for step in range(1, S):
            # Feed the K expanded nodes of depth `step` at position base+step-1; each sees the committed
            # prefix, the entries of its own ancestors and itself.
            past = base + K * (step - 1)
            mask = torch.ones(K, past + K, dtype=torch.bool, device=device)
            mask[:, base:past] = ancestors
            mask[:, past:] = eye
            pos = positions[:, base + step - 1:base + step].expand(1, K)
            hidden, logits = self._draft_forward(expanded_tokens.view(1, K), expanded_hidden, pos, dcache,
                                                 mask[None, None])
            stats.drafter_forwards += 1
            child_scores = expanded_scores[:, None] + torch.log_softmax(logits[0].float(), dim=-1)
            top_scores, top_ids = child_scores.topk(K, dim=-1)  # [K, K]
            top_scores, top_ids = top_scores.reshape(-1), top_ids.reshape(-1)
            parent_rows = rows.repeat_interleave(K)
            cand_tokens.append(self.draft_to_target[top_ids])
            cand_scores.append(top_scores)
            cand_parents.append(expanded_index[parent_rows])
            cand_depths.append(torch.full((K * K,), step + 1, device=device, dtype=torch.long))
            if step < S - 1:
                best = top_scores.topk(K).indices
                chosen_parent = parent_rows[best]
                ancestors = torch.cat([ancestors[chosen_parent], eye[chosen_parent]], dim=1)
                expanded_hidden = hidden[:, chosen_parent]
                expanded_tokens, expanded_scores = cand_tokens[-1][best], top_scores[best]
                expanded_index = offset + best
            offset += K * K

        # The tree: the D-1 best candidates. A stable sort keeps a parent (score >= its child's, smaller
        # index) ahead of its children, so the chosen set is closed under ancestors.
        tokens, scores = torch.cat(cand_tokens), torch.cat(cand_scores)
        parents, depths = torch.cat(cand_parents), torch.cat(cand_depths)
        chosen = torch.sort(-scores, stable=True).indices[:D - 1].sort().values
        slot = torch.full((tokens.shape[0],), -1, device=device, dtype=torch.long)
        slot[chosen] = torch.arange(1, D, device=device)
        chosen_parents = parents[chosen]
        tree_parent = torch.cat([torch.zeros(1, device=device, dtype=torch.long),
                                 torch.where(chosen_parents < 0, 0, slot[chosen_parents.clamp_min(0)])])
        tree_eye = torch.eye(D, dtype=torch.bool, device=device)
        tree_anc = tree_eye
        for _ in range(S):
            tree_anc = tree_eye | tree_anc[tree_parent]
        tree_tokens = torch.cat([root.view(1), tokens[chosen]])  # [D]
        tree_positions = (base + torch.cat([torch.zeros(1, device=device, dtype=torch.long), depths[chosen]]))
        allowed = torch.cat([torch.ones(D, base, dtype=torch.bool, device=device), tree_anc], dim=1)
        verifier_dtype = next(self.verifier.model.parameters()).dtype
        logits = self.verifier(tree_tokens.view(1, D), vcache, position_ids=tree_positions.view(1, D),
                               attention_mask=self.verifier.tree_mask(allowed, verifier_dtype))[0]  # [D, V]
        aux = capture.take_concatenated()
        # The verifier's token at every node: argmax, or one independent draw from p at that node.
        want = self.sampler.pick(logits)
        packed = torch.cat([want, tree_tokens[1:], tree_parent[1:]]).tolist()  # the one sync
        want, node_tokens, node_parents = packed[:D], [None] + packed[D:2 * D - 1], [None] + packed[2 * D - 1:]
        children: dict[int, list[int]] = {}
        for node in range(1, D):
            children.setdefault(node_parents[node], []).append(node)
        path, node = [], 0
        while True:
            follow = next((c for c in children.get(node, ()) if node_tokens[c] == want[node]), None)
            if follow is None:
                break
            path.append(follow)
            node = follow
        new = [node_tokens[c] for c in path] + [want[node]]
        keep = [0] + path
        self.verifier.keep(vcache, base, keep)
        keep_index = torch.tensor(keep, device=device)
        ext_tokens = torch.tensor(new, device=device, dtype=torch.long).view(1, len(new))
        return new, ext_tokens, aux[:, keep_index]
