"""The GRPO step between the engines: pack rollouts without padding, compute log-prob matrices,
and run the clipped policy update with losses normalised over the global mini-batch.

Works with any policy exposing ``forward_logprobs``/``backward``/``step`` (rlcore.engine.policy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlcore.algo import advantage, rollout_correction
from rlcore.dist import all_rank_means, all_rank_sums, all_reduce_max, all_reduce_sum

if TYPE_CHECKING:  # annotations only: pure math imports no config at run time
    from rlcore.config import AlgorithmConfig


@dataclass
class RolloutBatch:
    """One rank's share of a step's samples, groups of ``group_size`` consecutive sequences."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logp: list[list[float]]  # vLLM's log-probs of the sampled tokens
    answers: list[str]
    finish_reasons: list[str]
    group_size: int
    keep: list[float] | None = None  # per-sequence loss weight (0 masks a sequence out); None = all 1
    # Image prompts: each sample's rlcore.task.images.VisionInputs (or None), one object per prompt shared
    # by its group; prompt_ids are then the expanded ids. None: a text-only batch.
    vision: list | None = None
    # Routing replay's token keys: each sample's index in the step's batch, and the index of the
    # run of equal prompts it belongs to (its group); both carried through select().
    uids: list[int] | None = None
    gids: list[int] | None = None
    # Multi-turn (rlcore.agent): per response token 1 = sampled by the policy (trained), 0 = a tool's
    # or environment's token (context only); the ids of each sample's final model turn (what the
    # rule rewards read); the environment's reward. None: single-turn.
    env_mask: list[list[int]] | None = None
    final_ids: list[list[int]] | None = None
    env_rewards: list[float | None] | None = None
    conversations: list | None = None  # each sample's rlcore.agent.loop.Conversation (metrics, val samples)
    # R3 (algorithm.routing_replay: r3): per sample vLLM's routed experts, (P + R - 1, layers, K)
    # uint8/uint16 rows for every token it ran a forward for (rlcore.rollout.routing). None: off.
    routed_experts: list | None = None
    rows: list[dict] | None = None  # each sample's data row (model-based rewards read its fields)

    def __post_init__(self):
        if self.keep is None:
            self.keep = [1.0] * len(self.response_ids)
        if self.uids is None:
            self.uids = list(range(len(self.response_ids)))
        if self.gids is None:
            self.gids = [k for k, (a, b) in enumerate(prompt_runs(self.prompt_ids, self.vision)) for _ in range(a, b)]

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, idx: list[int]) -> "RolloutBatch":
        values = {f: getattr(self, f) for f in _PER_SAMPLE}
        return RolloutBatch(group_size=self.group_size,
                            **{f: None if v is None else [v[i] for i in idx] for f, v in values.items()})

    def response_mask(self) -> torch.Tensor:
        """(N, T) 1 on response tokens of kept sequences: the loss mask."""
        n, t = len(self), max(1, max(len(r) for r in self.response_ids))
        mask = torch.zeros(n, t)  # (N, T)
        for i, r in enumerate(self.response_ids):
            mask[i, : len(r)] = self.keep[i]
            if self.env_mask is not None:  # tool/environment tokens: context, never trained
                mask[i, : len(r)] *= torch.tensor(self.env_mask[i], dtype=mask.dtype)
        return mask

    def rollout_logp_matrix(self) -> torch.Tensor:
        mask = self.response_mask()
        out = torch.zeros_like(mask)  # (N, T)
        for i, lp in enumerate(self.rollout_logp):
            out[i, : len(lp)] = torch.tensor(lp, dtype=out.dtype)
        return out


def shape_rewards(scores: torch.Tensor, batch: RolloutBatch, cfg: AlgorithmConfig,
                  max_response_length: int) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO overlong shaping and truncation masking; returns the shaped scores (N,)."""
    metrics = {}
    if cfg.overlong_buffer_len > 0:
        lengths = torch.tensor([len(r) for r in batch.response_ids], dtype=scores.dtype)
        penalty = advantage.overlong_penalty(lengths, max_response_length, cfg.overlong_buffer_len,
                                             cfg.overlong_penalty_factor)
        scores = scores + penalty
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
    if cfg.mask_truncated:
        batch.keep = [0.0 if f == "length" else k for f, k in zip(batch.finish_reasons, batch.keep)]
    return scores, metrics


def advantages_for(batch: RolloutBatch, scores: torch.Tensor, cfg: AlgorithmConfig, tp_size: int = 1) -> torch.Tensor:
    """(N, T) advantages of the configured estimator, zero off the loss mask. Batch-level
    statistics (REINFORCE++ whitening) are those of the global batch: summed over all ranks, each
    replica counted once (the ``tp_size`` ranks of a replica hold the same samples here)."""
    def sum_fn(values: list[float]) -> list[float]:
        return [v / tp_size for v in all_reduce_sum(values)]

    return advantage.compute_advantages(cfg.adv_estimator, scores, batch.response_mask(), batch.group_size,
                                        norm_by_std=cfg.norm_by_std, gamma=cfg.gamma, sum_fn=sum_fn)


def informative_groups(scores: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    degenerate = advantage.group_is_degenerate(scores, group_size)
    return [g for g in range(len(degenerate)) if not degenerate[g]]


# RolloutBatch's per-sample lists, carried by select() and concat() (uids/gids are renumbered by concat)
_PER_SAMPLE = ("prompt_ids", "response_ids", "rollout_logp", "answers", "finish_reasons", "keep", "vision", "uids",
               "gids", "env_mask", "final_ids", "env_rewards", "conversations", "routed_experts", "rows")


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    def cat(attr: str):
        if all(getattr(b, attr) is None for b in batches):
            return None
        return [x for b in batches for x in (getattr(b, attr) if getattr(b, attr) is not None else [None] * len(b))]

    return RolloutBatch(group_size=batches[0].group_size,
                        **{f: cat(f) for f in _PER_SAMPLE if f not in ("uids", "gids")})


def prompt_runs(prompt_ids: list[list[int]], vision: list | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive sequences with the same prompt: a group, or
    the part of one this rank or micro-batch holds (TP sharding and micro-batch splits may cut a
    group; dynamic sampling keeps groups together). With images the prompt must also be the same
    object (two prompts with the same text and differently drawn images expand to equal ids)."""
    runs: list[tuple[int, int]] = []
    same_images = (lambda i, j: True) if vision is None else (lambda i, j: vision[i] is vision[j])  # noqa: E731
    for i, p in enumerate(prompt_ids):
        if runs and prompt_ids[runs[-1][0]] == p and same_images(runs[-1][0], i):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], device, *, share_prompt: bool = False,
         response_only: bool = True, vision: list | None = None) -> dict[str, torch.Tensor | None]:
    """Concatenate sequences without padding into one ``(1, L)`` row for ``forward_logprobs``.

    Unshared, each sequence is ``prompt + response`` with positions restarting at 0. With
    ``share_prompt``, each prompt run (``prompt_runs``) is ``[prompt, r1, ..., rn]``: every
    response's positions continue from the prompt's length and ``attention_mask`` (1, 1, L, L)
    lets a token see its run's prompt and its own response only, so the prompt is computed once
    and its gradient is the sum over the run's samples, as if each sample had its own copy.

    ``select`` (K,) lists the packed positions whose hidden states predict a response token, one
    per response token in order (the prompt's last position once per sample of a shared run);
    ``labels`` (1, K) are those tokens, and ``gather`` (N, T) indexes each response token's
    log-prob in the (1, K) result. ``response_only=False`` (benchmarks only) projects every
    position instead: ``select`` None, ``labels`` (1, L) with -100 off the responses.

    ``vision`` (per sequence ``rlcore.task.images.VisionInputs`` or None): ``position_ids`` becomes
    (4, 1, L), the text positions above on row 0 (what the attention mask is derived from) and the
    M-RoPE (t, h, w) positions on rows 1-3 (a response continues at its prompt's next position);
    ``mm`` holds the ``pixel_values`` and ``image_grid_thw`` of every prompt copy in the row, in
    order (a shared prompt's images once).
    """
    ids, pos, seg, run_of, select, labels = [], [], [], [], [], []
    rope, pixels, grids = [], [], []  # image prompts: (3, len) position blocks, per-copy pixels and grids
    t_max = max(1, max(len(r) for r in response_ids))
    gather = torch.zeros(len(response_ids), t_max, dtype=torch.long)  # (N, T)
    runs = prompt_runs(prompt_ids, vision) if share_prompt else [(i, i + 1) for i in range(len(prompt_ids))]
    for k, (a, b) in enumerate(runs):
        p = prompt_ids[a]
        base = len(ids)
        ids += p
        pos += range(len(p))
        seg += [0] * len(p)
        if vision is not None:
            v = vision[a]
            rope.append(torch.arange(len(p)).expand(3, -1) if v is None else v.positions)
            if v is not None:
                pixels.append(v.pixel_values)
                grids.append(v.image_grid_thw)
        for i in range(a, b):
            r = response_ids[i]
            start = len(ids)
            # A response's last token is only a label (nothing predicts from it). Image rows write
            # the prompt's last token there instead: a sample that stopped at a vision slot token
            # (rlcore.rollout.checks.slot_token_ids) would otherwise read as an image slot.
            ids += r if vision is None or not r else r[:-1] + [p[-1]]
            pos += range(len(p), len(p) + len(r))
            seg += [i + 1] * len(r)
            if vision is not None:
                nxt = len(p) if vision[a] is None else vision[a].next_position
                rope.append(torch.arange(nxt, nxt + len(r)).expand(3, -1))
            # r[0] is predicted at the prompt's last position, r[j] at r[j-1]'s
            here = [base + len(p) - 1] + list(range(start, start + len(r) - 1))
            gather[i, : len(r)] = torch.arange(len(select), len(select) + len(r))
            select += here[: len(r)]
            labels += r
        run_of += [k] * (len(ids) - base)
    as_row = lambda xs: torch.tensor(xs, dtype=torch.long, device=device).unsqueeze(0)  # noqa: E731
    out = {"input_ids": as_row(ids), "position_ids": as_row(pos), "attention_mask": None,
           "select": torch.tensor(select, dtype=torch.long, device=device), "labels": as_row(labels),
           "gather": gather.to(device), "mm": None}
    if vision is not None:
        rows = torch.cat([torch.tensor(pos).unsqueeze(0), torch.cat(rope, dim=1)])  # (4, L)
        out["position_ids"] = rows.unsqueeze(1).to(device)  # (4, 1, L)
        if pixels:
            out["mm"] = {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device)}
    if share_prompt:
        out["attention_mask"] = shared_prompt_mask(torch.tensor(run_of), torch.tensor(seg)).to(device)
    if not response_only:  # the full-row form: labels at the selected positions, -100 elsewhere
        if share_prompt:
            raise ValueError("share_prompt needs response_only: the prompt's last position predicts n tokens")
        full = torch.full((len(ids),), -100, dtype=torch.long)
        full[out["select"].cpu()] = out["labels"][0].cpu()
        out["gather"] = out["select"][out["gather"]]
        out.update(select=None, labels=full.to(device).unsqueeze(0))
    return out


def token_key(owner: int, position: int, prompt: bool = False) -> int:
    """One int64 per (owner, position): owner a sample uid (response) or a group (prompt)."""
    return ((2 * owner + int(prompt)) << 24) + position


def token_keys(batch: RolloutBatch, device, share_prompt: bool = False) -> torch.Tensor:
    """(1, L) int64 name of each position of ``pack``'s row, for routing replay: the same however
    the samples are packed, (sample uid, position) for a response token and (group gid, position)
    for a prompt token, which every sample of the group sees alike. Built only when replay is on."""
    runs = prompt_runs(batch.prompt_ids, batch.vision) if share_prompt else [(i, i + 1) for i in range(len(batch))]
    keys = []
    for a, b in runs:
        n = len(batch.prompt_ids[a])
        keys += [token_key(batch.gids[a], j, prompt=True) for j in range(n)]
        for i in range(a, b):
            keys += [token_key(batch.uids[i], j) for j in range(n, n + len(batch.response_ids[i]))]
    return torch.tensor(keys, dtype=torch.long, device=device).unsqueeze(0)


def rollout_routing(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R3's replay rows from vLLM's routed experts: keys (M,) as ``token_keys`` names the tokens,
    experts (M, layers, K) in vLLM's dtype (its layer index is the decoder layer's), and the keys
    of the tokens vLLM ran no forward for (each response's last token: nothing is predicted from
    it, so its routing changes no log-prob), which keep their native choice. A group's prompt
    rows come from its first sample (vLLM routes a shared prompt once; prefix-cached blocks keep
    their routing)."""
    keys, rows, free, groups = [], [], [], set()
    for i, (p, r, experts) in enumerate(zip(batch.prompt_ids, batch.response_ids, batch.routed_experts)):
        total = len(p) + len(r)
        if experts is None or len(experts) != total - 1:
            raise RuntimeError(f"routing replay r3: sample {i} has {None if experts is None else len(experts)} rows "
                               f"of routed experts from vLLM for {total} tokens (expected {total - 1}: the prompt "
                               f"and every sampled token but the last)")
        gid, uid = batch.gids[i], batch.uids[i]
        start = len(p) if gid in groups else 0
        groups.add(gid)
        keys += [token_key(gid, j, prompt=True) for j in range(start, len(p))]
        keys += [token_key(uid, j) for j in range(max(start, len(p)), total - 1)]
        part = torch.as_tensor(np.asarray(experts[start:]))
        rows.append(part if part.dtype == torch.uint8 else part.to(torch.int32))  # torch indexes no uint16
        free.append(token_key(uid, total - 1))
    return torch.tensor(keys, dtype=torch.long), torch.cat(rows), torch.tensor(free, dtype=torch.long)


def shared_prompt_mask(run: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """(1, 1, L, L) bool, True where query q may attend to key k: same run, k not after q, and k
    in the prompt (segment 0) or in q's own response. Dense, as sdpa and eager take it."""
    q, k = torch.arange(len(run)).unsqueeze(1), torch.arange(len(run)).unsqueeze(0)  # (L, 1), (1, L)
    same_run = run.unsqueeze(1) == run.unsqueeze(0)
    visible = (seg.unsqueeze(0) == 0) | (seg.unsqueeze(1) == seg.unsqueeze(0))
    return (same_run & visible & (k <= q))[None, None]


def logprob_matrix(policy, batch: RolloutBatch, temperature: float, *, grad: bool, with_entropy: bool,
                   device, share_prompt: bool = False, response_only: bool = True, routing_keys: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of the response tokens as (N, T) matrices, 0 where masked."""
    packed = pack(batch.prompt_ids, batch.response_ids, device, share_prompt=share_prompt,
                  response_only=response_only, vision=batch.vision)
    extra = {"mm": packed["mm"]} if batch.vision is not None else {}  # text policies take no mm argument
    if routing_keys:
        extra["token_keys"] = token_keys(batch, device, share_prompt)
    logp, ent = policy.forward_logprobs(packed["input_ids"], packed["position_ids"], packed["labels"],
                                        temperature=temperature, with_entropy=with_entropy, grad=grad,
                                        select=packed["select"], attention_mask=packed["attention_mask"], **extra)
    mask = batch.response_mask().to(device)
    logp_mat = logp[0][packed["gather"]] * mask  # (N, T)
    ent_mat = ent[0][packed["gather"]] * mask if ent is not None else None
    return logp_mat, ent_mat


def describe_train_phase(cfg: AlgorithmConfig) -> str:
    """One start-up line: what the train phase computes once and what it skips."""
    head = "response-only logits" if cfg.response_only_logits else "logits at every position"
    share = ("one prompt per group (block mask)" if cfg.share_prompt
             else "each sample with its own prompt copy (algorithm.share_prompt off)")
    micro = (f"micro-batches up to {cfg.micro_batch_tokens} tokens" if cfg.micro_batch_tokens
             else f"micro-batches of {cfg.micro_batch_size} sequences")
    return f"train phase: {head}, {share}, {micro}"


def _pack_options(cfg: AlgorithmConfig | int) -> dict[str, bool]:
    if isinstance(cfg, int):  # a plain micro-batch size: the defaults
        return {}
    return {"share_prompt": bool(cfg.share_prompt), "response_only": cfg.response_only_logits,
            "routing_keys": cfg.routing_replay is not None}


def micro_batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def token_budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions 0..len(lengths)-1 split into micro-batches of about ``budget`` tokens (collective).

    Every rank must run the same number of forwards (FSDP2 gathers each layer in every forward),
    so the count is the largest any rank needs, ceil(tokens / budget), at most the number of
    items the emptiest rank holds. Items (sequences, or prompt runs) go longest first to the lightest micro-batch,
    which keeps the token counts within one sequence of each other; within a micro-batch they keep
    their order.
    """
    need = max(1, -(-sum(lengths) // budget))
    # at most the fewest items a rank holds (ranks hold as many sequences, not as many prompt runs)
    most, fewest = all_reduce_max([float(need), -float(len(lengths))])
    count = int(min(most, -fewest))
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = loads.index(min(loads))
        bins[j].append(i)
        loads[j] += lengths[i]
    return [sorted(b) for b in bins]


def split_micro(batch: RolloutBatch, idx: list[int], cfg: AlgorithmConfig) -> list[list[int]]:
    """``idx`` (a mini-batch's sequences) as micro-batches: by token budget or by count. With a
    token budget and a shared prompt, a prompt run is packed whole (its tokens: the prompt once
    plus its responses), so a split never costs a second copy of the prompt."""
    if not cfg.micro_batch_tokens:
        return [idx[i: i + cfg.micro_batch_size] for i in range(0, len(idx), cfg.micro_batch_size)]
    prompts = [batch.prompt_ids[i] for i in idx]
    vision = None if batch.vision is None else [batch.vision[i] for i in idx]
    units = prompt_runs(prompts, vision) if cfg.share_prompt else [(k, k + 1) for k in range(len(idx))]
    lengths = [len(prompts[a]) * (1 if cfg.share_prompt else b - a)
               + sum(len(batch.response_ids[idx[k]]) for k in range(a, b)) for a, b in units]
    parts = token_budget_batches(lengths, cfg.micro_batch_tokens)
    return [[idx[k] for u in part for k in range(*units[u])] for part in parts]


@torch.no_grad()
def compute_logprobs_in_chunks(policy, batch: RolloutBatch, temperature: float, micro: int | AlgorithmConfig,
                               device) -> torch.Tensor:
    """(N, T) log-probs without grad, micro-batch by micro-batch (old or reference policy);
    ``micro``: sequences per micro-batch, or the algorithm config (its token budget when set)."""
    t = batch.response_mask().shape[1]
    out = torch.zeros(len(batch), t, device=device)
    every = list(range(len(batch)))
    parts = split_micro(batch, every, micro) if not isinstance(micro, int) else micro_batches(len(batch), micro)
    for idx in parts:
        part, _ = logprob_matrix(policy, batch.select(idx), temperature, grad=False, with_entropy=False,
                                 device=device, **_pack_options(micro))
        out[idx, : part.shape[1]] = part
    return out


@dataclass
class UpdateInputs:
    """What every micro-batch of one update reads: (N, T) matrices of this rank's samples on the
    device (None where unused) and the normalisation constants."""

    adv: torch.Tensor
    old_logp: torch.Tensor | None  # None: on-policy, the current log-probs detached
    ref_logp: torch.Tensor | None  # None: no KL loss
    rollout_logp: torch.Tensor  # vLLM's sampling log-probs
    mask: torch.Tensor  # the loss mask
    temperature: float
    world_size: int
    norm_len: int | None = None  # seq-mean-token-sum-norm's fixed divisor
    tis_cap: float | None = None  # truncated importance sampling (rollout_correction.tis_cap)
    clip_cov: dict | None = None  # Clip-Cov's ratio, low, high (exploration.clip_cov_*); None = off
    is_weights: torch.Tensor | None = None  # (N, T) rollout-correction weights; None = 1


def ppo_update(policy, batch: RolloutBatch, adv: torch.Tensor, old_logp: torch.Tensor | None,
               ref_logp: torch.Tensor | None, cfg: AlgorithmConfig, temperature: float,
               world_size: int, device, norm_len: int | None = None, tis_cap: float | None = None,
               clip_cov: dict | None = None, correction: rollout_correction.Correction | None = None
               ) -> dict[str, float]:
    """ppo_epochs x mini_batches optimizer steps on this rank's samples.

    Each micro-batch loss is normalised by the global mini-batch's token (or sequence) count and
    multiplied by world_size, so FSDP's gradient averaging yields the gradient of the global loss
    whatever the micro-batch size or the number of ranks. ``old_logp`` None means on-policy
    (one epoch, one mini-batch): the ratio's denominator is the current log-prob, detached.
    ``norm_len`` (the max response length) fixes seq-mean-token-sum-norm's divisor, which would
    otherwise be each micro-batch's own padded length. ``correction``: rollout correction's
    weights and the tokens it keeps (the others leave the loss and its normaliser).
    """
    mask = batch.response_mask().to(device)
    inp = UpdateInputs(adv.to(device), old_logp, ref_logp, batch.rollout_logp_matrix().to(device),
                       mask if correction is None else mask * correction.keep.to(device), temperature, world_size,
                       norm_len, tis_cap, clip_cov, None if correction is None else correction.weights)
    sums: dict[str, float] = {}
    step_metrics: list[dict] = []
    # The trainer's log-probs before any update, to compare with vLLM's: old_logp, or recorded by
    # the single on-policy mini-batch (its optimizer step comes after all its micro-batches).
    # With use_rollout_logprobs, old_logp is vLLM's own: record the trainer's then too.
    record = old_logp is None or cfg.use_rollout_logprobs
    pre_update = torch.zeros_like(inp.mask) if record else old_logp
    for _ in range(cfg.ppo_epochs):
        for mini in micro_batches(len(batch), len(batch) // cfg.mini_batches):
            accumulate_gradients(policy, batch, mini, inp, cfg, sums, record=pre_update if record else None)
            step_metrics.append(policy.step())
    metrics = _reduce_update_metrics(sums, step_metrics, world_size)
    metrics.update(mismatch_metrics(pre_update, inp.rollout_logp, mask))  # every sampled token, rejected or not
    return metrics


def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far vLLM's sampling log-probs are from the trainer's on the same weights (all ranks):
    ``rollout/mismatch_kl`` the masked mean k3 estimate of KL(rollout || trainer) (the tokens were
    sampled by vLLM), ``rollout/mismatch_max`` the largest |difference| of one token. Kernels,
    dtypes and (for MoE) routing make them differ; a stale or partial weight sync shows here."""
    k3 = advantage.kl_penalty(rollout_logp, trainer_logp, "k3")  # (N, T)
    diff = (trainer_logp - rollout_logp).abs() * mask  # (N, T)
    sums = all_rank_sums({"k3": (k3 * mask).sum().item(), "tokens": mask.sum().item()})
    return {"rollout/mismatch_kl": sums["k3"] / max(sums["tokens"], 1.0),
            "rollout/mismatch_max": all_reduce_max([diff.max().item() if diff.numel() else 0.0])[0]}


def accumulate_gradients(policy, batch: RolloutBatch, mini: list[int], inp: UpdateInputs, cfg: AlgorithmConfig,
                         sums: dict | None = None, record: torch.Tensor | None = None) -> None:
    """Forward/backward one mini-batch (indices ``mini``) in micro-batches, normalised by the
    mini-batch's token and sequence counts over all ranks; ``record`` (N, T) receives the log-probs."""
    totals = all_reduce_sum([inp.mask[mini].sum().item(), float((inp.mask[mini].sum(1) > 0).sum())])
    agg = {"global_tokens": totals[0], "global_seqs": totals[1], "dp_size": inp.world_size,
           "norm_len": inp.norm_len}
    for idx in split_micro(batch, mini, cfg):
        _micro_step(policy, batch, idx, inp, cfg, agg, {} if sums is None else sums, record)


def _micro_step(policy, batch: RolloutBatch, idx: list[int], inp: UpdateInputs, cfg: AlgorithmConfig,
                agg: dict, sums: dict, record: torch.Tensor | None) -> None:
    sub = batch.select(idx)
    logp, ent = logprob_matrix(policy, sub, inp.temperature, grad=True, with_entropy=True,
                               device=inp.mask.device, **_pack_options(cfg))  # (n, t) each
    t = logp.shape[1]
    if record is not None:
        record[idx, :t] = logp.detach()
    mask, a = inp.mask[idx, :t], inp.adv[idx, :t]
    old = logp.detach() if inp.old_logp is None else inp.old_logp[idx, :t]
    is_weights = _token_weights(logp, old, idx, a, mask, inp, cfg, sums)
    pg_loss, pg_metrics = advantage.policy_loss(
        cfg.policy_loss, logp, old, a, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip_c=cfg.dual_clip_c, agg_mode=cfg.loss_agg_mode, is_weights=is_weights, **agg)
    loss = pg_loss
    ntok = mask.sum().item()
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * advantage.aggregate_loss(ent, mask, cfg.loss_agg_mode, **agg)
    if inp.ref_logp is not None:
        kl = advantage.kl_penalty(logp, inp.ref_logp[idx, :t], cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * advantage.aggregate_loss(kl, mask, cfg.loss_agg_mode, **agg)
        _add(sums, "actor/kl", (kl.detach() * mask).sum().item())
    policy.backward(loss)
    _add(sums, "actor/pg_loss", pg_loss.item())
    _add(sums, "actor/entropy", (ent.detach() * mask).sum().item())
    _add(sums, "tokens", ntok)
    for k, v in pg_metrics.items():  # masked means over this micro-batch -> token-weighted sums
        _add(sums, k, v * ntok)


def _token_weights(logp, old, idx: list[int], adv, mask, inp: UpdateInputs, cfg: AlgorithmConfig, sums: dict
                   ) -> torch.Tensor | None:
    """(n, t) multipliers of the per-token policy loss: rollout correction's or TIS weights times
    Clip-Cov's 0/1 mask; None when none is on."""
    t = logp.shape[1]
    weights = None if inp.is_weights is None else inp.is_weights[idx, :t]
    if inp.tis_cap is not None:
        weights, clipped = tis_weights(old, inp.rollout_logp[idx, :t], mask, inp.tis_cap)
        _add(sums, "rollout/tis_clip_frac", clipped)
    if inp.clip_cov is not None:
        keep, dropped = advantage.clip_cov_weights(logp, old, adv, mask, clip_low=cfg.clip_low,
                                                   clip_high=cfg.clip_high, **inp.clip_cov)
        weights = keep if weights is None else weights * keep
        _add(sums, "actor/clip_cov_frac", dropped)
    return weights


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float
                ) -> tuple[torch.Tensor, float]:
    """Truncated importance weights min(exp(old - rollout), cap) (N, T), detached (they correct
    the sampling distribution, they are not optimised), and the count of masked tokens capped."""
    ratio = torch.exp(old_logp.detach() - rollout_logp)  # (N, T)
    return ratio.clamp(max=cap), ((ratio > cap) * mask).sum().item()


def _add(sums: dict, key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _reduce_update_metrics(sums: dict, step_metrics: list[dict], world_size: int) -> dict[str, float]:
    totals = all_rank_sums(sums)
    tokens = max(totals.pop("tokens"), 1.0)
    n_steps = len(step_metrics)
    out = {k: v / tokens for k, v in totals.items()}
    # pg_loss: the sum over micro-batches of each rank's scaled loss, averaged over ranks and steps
    out["actor/pg_loss"] = totals["actor/pg_loss"] / world_size / n_steps
    out.setdefault("actor/kl", 0.0)
    for key in step_metrics[0]:
        out[key] = sum(m[key] for m in step_metrics) / (1 if key == "actor/skipped" else n_steps)
    return out


def train_on_batch(policy, ref, batch: RolloutBatch, adv: torch.Tensor, cfg: AlgorithmConfig, temperature: float,
                   world_size: int, device, norm_len: int, tis_cap: float | None = None,
                   clip_cov: dict | None = None, correction: dict | None = None) -> dict[str, float]:
    """The train phase of one step: old and reference log-probs when needed, then the update
    (``tis_cap``: rollout_correction.tis_cap; ``clip_cov``: advantage.clip_cov_weights' ratio, low,
    high; ``correction``: RolloutCorrectionConfig.options(), which needs the old log-probs first).
    With ``algorithm.routing_replay: r2`` the old log-prob forward records each token's experts
    and every forward of the update replays them; with r3 every forward replays vLLM's."""
    on_policy = cfg.ppo_epochs == 1 and cfg.mini_batches == 1
    replay = {"r2": "record", "r3": "replay"}.get(cfg.routing_replay)
    rows = rollout_routing(batch) if cfg.routing_replay == "r3" else None
    if cfg.use_rollout_logprobs:  # vLLM's log-probs as the ratio's denominator: no recompute
        old = batch.rollout_logp_matrix().to(device)
    elif on_policy and correction is None and replay != "record":
        old = None
    else:
        with _routing(policy, replay, rows):
            old = compute_logprobs_in_chunks(policy, batch, temperature, cfg, device)
        rows = None  # loaded: the update replays the same
    ref_logp = None
    if ref is not None:
        with ref.on_device():  # an offloaded reference comes to the device once per step, not per micro-batch
            ref_logp = compute_logprobs_in_chunks(ref, batch, temperature, cfg, device)
    corr, extra = None, {}
    if correction is not None:
        corr, sums = rollout_correction.correct(old, batch.rollout_logp_matrix().to(device),
                                                batch.response_mask().to(device), **correction)
        w_max = all_reduce_max([sums.pop("w_max", 0.0)])[0]
        extra = rollout_correction.summarise(all_rank_sums(sums), w_max)
    with _routing(policy, replay and "replay", rows):
        metrics = ppo_update(policy, batch, adv.to(device), old, ref_logp, cfg, temperature, world_size, device,
                             norm_len=norm_len, tis_cap=tis_cap, clip_cov=clip_cov, correction=corr)
    if replay:
        extra.update(policy.routing_metrics())
    return {**metrics, **extra}


def _routing(policy, mode: str | None, rows: tuple | None = None):
    """The policy's routing-replay context for ``mode`` (R3's ``rows`` loaded first); nothing when None."""
    return contextlib.nullcontext() if mode is None else policy.routing(mode, rows)


def rollout_metrics(batch: RolloutBatch, scores: torch.Tensor, adv: torch.Tensor, metrics: dict,
                    world_size: int, tp_size: int) -> dict[str, float]:
    """Global (all-rank) statistics of the step's samples, merged with the phase ``metrics``
    (reward components and filter fractions are per-rank means: averaged over ranks)."""
    mask = batch.response_mask()
    # Generated tokens: multi-turn conversations also hold tool answers (prefilled, not generated).
    lens = [len(r) for r in batch.response_ids] if batch.env_mask is None else [sum(m) for m in batch.env_mask]
    g = all_rank_sums({
        "s": scores.sum().item(), "s2": (scores ** 2).sum().item(), "cnt": len(scores), "ntok": sum(lens),
        "nall": float(sum(len(r) for r in batch.response_ids)),
        "trunc": float(sum(f == "length" for f in batch.finish_reasons)), "ntok_loss": mask.sum().item(),
        "a1": (adv * mask).sum().item(), "a2": (adv ** 2 * mask).sum().item()})
    out = dict(metrics)
    per_replica = ("reward/", "rollout/filtered", "rollout/zero_variance")
    out.update(all_rank_means({k: v for k, v in metrics.items() if k.startswith(per_replica)}, world_size))
    if "reward/errors" in out:  # a count: the sum over replicas (TP ranks score the same samples)
        out["reward/errors"] *= world_size / tp_size
    mean, a_mean, ntok_loss = g["s"] / g["cnt"], g["a1"] / max(g["ntok_loss"], 1), max(g["ntok_loss"], 1)
    out.update({
        "reward/mean": mean, "reward/std": max(g["s2"] / g["cnt"] - mean ** 2, 0.0) ** 0.5,
        "rollout/response_len_mean": g["ntok"] / g["cnt"], "rollout/truncated_frac": g["trunc"] / g["cnt"],
        "rollout/tokens": g["ntok"],
        **({"rollout/conversation_len_mean": g["nall"] / g["cnt"]} if batch.env_mask is not None else {}),
        "advantage/mean": a_mean, "advantage/std": max(g["a2"] / ntok_loss - a_mean ** 2, 0.0) ** 0.5,
    })
    return out
