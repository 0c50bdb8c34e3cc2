"""The GRPO/PPO update: log-prob matrices over packed rows, the clipped policy loss normalised
over the global mini-batch, PPO epochs and mini-batches, rollout-correction weights, the
update's metrics. The batch and its packing are in ``rlcore.algo.batch`` and ``rlcore.algo.packing``.

Works with any policy exposing ``forward_logprobs``/``backward``/``step`` (``rlcore.protocols.Policy``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlcore import advantage
from rlcore.algo import rollout_correction
from rlcore.algo.batch import RolloutBatch, concat
from rlcore.algo.distill import topk_divergence
from rlcore.algo.log_prob import describe_log_prob_micro, log_prob_micro
from rlcore.algo.packing import micro_batches, pack, rollout_routing, split_micro, token_keys
from rlcore.dist import all_gather_objects, all_rank_sums, all_reduce_max, all_reduce_sum

if TYPE_CHECKING:  # annotations only
    from rlcore.algo.config import AlgorithmConfig


def logprob_matrix(policy, batch: RolloutBatch, temperature: float, *, grad: bool, with_entropy: bool,
                   device, share_prompt: bool = False, response_only: bool = True, routing_keys: bool = False,
                   topk_ids: torch.Tensor | None = None):
    """Per-token log-probs (and entropy) of the response tokens as (N, T) matrices, 0 where masked.

    ``topk_ids`` (N, T, k): also the log-probs of these tokens at each response position, returned
    third as (N, T, k). They come from the same forward: each position's hidden state goes through
    the LM head once per extra token (``forward_logprobs``' ``select`` may repeat positions)."""
    packed = pack(batch.prompt_ids, batch.response_ids, device, share_prompt=share_prompt,
                  response_only=response_only, vision=batch.vision)
    extra = {"mm": packed["mm"]} if batch.vision is not None else {}  # text policies take no mm argument
    if routing_keys:
        extra["token_keys"] = token_keys(batch, device, share_prompt)
    mask = batch.response_mask().to(device)
    select, labels, n_own = packed["select"], packed["labels"], packed["labels"].shape[1]
    if topk_ids is not None:
        select, labels = _with_topk(packed, mask, topk_ids.to(device))
    logp, ent = policy.forward_logprobs(packed["input_ids"], packed["position_ids"], labels,
                                        temperature=temperature, with_entropy=with_entropy, grad=grad,
                                        select=select, attention_mask=packed["attention_mask"], **extra)
    logp_mat = logp[0][packed["gather"]] * mask  # (N, T)
    ent_mat = ent[0][packed["gather"]] * mask if ent is not None else None
    if topk_ids is None:
        return logp_mat, ent_mat
    topk = torch.zeros(topk_ids.shape, dtype=logp.dtype, device=device)  # (N, T, k)
    topk[mask > 0] = logp[0][n_own:].reshape(-1, topk_ids.shape[-1])
    return logp_mat, ent_mat, topk


def _with_topk(packed: dict, mask: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row's ``select`` and ``labels`` followed by each loss position repeated k times
    with the k token ids as labels (in the order of ``mask > 0``: row-major over (N, T))."""
    select = packed["select"]
    if select is None:  # every position through the LM head: name them, so extra ones can follow
        select = torch.arange(packed["labels"].shape[1], device=mask.device)
    where = select[packed["gather"]][mask > 0]  # (M,) packed position of each loss token
    k = topk_ids.shape[-1]
    return (torch.cat([select, where.repeat_interleave(k)]),
            torch.cat([packed["labels"][0], topk_ids[mask > 0].reshape(-1)])[None])


def describe_train_phase(cfg: AlgorithmConfig) -> str:
    """One start-up line: what the train phase computes once and what it skips."""
    head = "response-only logits" if cfg.response_only_logits else "logits at every position"
    share = ("one prompt per group (block mask)" if cfg.share_prompt
             else "each sample with its own prompt copy (algorithm.share_prompt off)")
    micro = (f"micro-batches up to {cfg.micro_batch_tokens} tokens" if cfg.micro_batch_tokens
             else f"micro-batches of {cfg.micro_batch_size} sequences")
    return f"train phase: {head}, {share}, {micro}{describe_log_prob_micro(cfg)}"


def _pack_options(cfg: AlgorithmConfig | int) -> dict[str, bool]:
    if isinstance(cfg, int):  # a plain micro-batch size: the defaults
        return {}
    return {"share_prompt": bool(cfg.share_prompt), "response_only": cfg.response_only_logits,
            "routing_keys": cfg.routing_replay is not None}


# ----------------------------------------------------------------------------- Ulysses groups

# What the train phase reads of a sample; the rest (conversations, images, data rows) stays home.
_TRAIN_FIELDS = ("prompt_ids", "response_ids", "rollout_logp", "keep", "env_mask", "teacher_topk", "staleness")


def sp_group_batch(policy, batch: RolloutBatch, *matrices: torch.Tensor):
    """Under Ulysses sequence parallelism (``policy.sp``) every rank of a group must run the same
    packed rows (``rlcore.engine.ulysses``): the group's samples, rank by rank, and the (N, T)
    ``matrices`` (advantages) gathered the same way; returns ``(batch, matrices, rows)`` with
    ``rows`` this rank's own indices in the group batch. Without it: the inputs, all rows.
    Each sample is then held by U ranks, which the loss's all-rank normaliser counts U times;
    the log-probs' summed gather gradient is U times one copy's: they cancel (the engine's docstring);
    token-sum, which has no normaliser, divides by U (advantage.aggregate_loss's ``copies``)."""
    sp = getattr(policy, "sp", None)
    if sp is None or sp.size == 1:
        return batch, list(matrices), list(range(len(batch)))
    # R3's rows and a VL batch's images (one object per prompt: its group's samples of one rank share it)
    fields = _TRAIN_FIELDS + tuple(f for f in ("routed_experts", "vision") if getattr(batch, f) is not None)
    mine = {f: getattr(batch, f) for f in fields}
    parts = all_gather_objects((mine, [m.cpu() for m in matrices]), sp.group)  # the group's ranks in order
    group = concat([RolloutBatch(group_size=batch.group_size, answers=[""] * len(p["response_ids"]),
                                 finish_reasons=["stop"] * len(p["response_ids"]), **p) for p, _ in parts])
    t = group.response_mask().shape[1]
    mats = [torch.cat([torch.nn.functional.pad(ms[k], (0, t - ms[k].shape[1])) for _, ms in parts])
            .to(matrices[k].device) for k in range(len(matrices))]
    start = sum(len(p["response_ids"]) for p, _ in parts[: sp.rank])
    return group, mats, list(range(start, start + len(batch)))


@torch.no_grad()
def compute_logprobs_in_chunks(policy, batch: RolloutBatch, temperature: float, micro: int | AlgorithmConfig,
                               device, shared: bool = False) -> torch.Tensor:
    """(N, T) log-probs without grad, micro-batch by micro-batch (old or reference policy);
    ``micro``: sequences per micro-batch, or the algorithm config (its token budget when set).
    ``shared``: the batch is already the same on every rank of a Ulysses group (else it is
    gathered over the group and this rank's rows returned)."""
    if not shared:
        group, _, rows = sp_group_batch(policy, batch)
        if len(group) != len(batch):
            out = _logprobs_in_chunks(policy, group, temperature, micro, device)[rows]
            return out[:, : batch.response_mask().shape[1]]
    return _logprobs_in_chunks(policy, batch, temperature, micro, device)


def _logprobs_in_chunks(policy, batch: RolloutBatch, temperature: float, micro: int | AlgorithmConfig,
                        device) -> torch.Tensor:
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
    distill: dict | None = None  # the top-k distillation term's divergence, beta, coef (distill.mode topk)


def ppo_update(policy, batch: RolloutBatch, adv: torch.Tensor, old_logp: torch.Tensor | None,
               ref_logp: torch.Tensor | None, cfg: AlgorithmConfig, temperature: float,
               world_size: int, device, norm_len: int | None = None, tis_cap: float | None = None,
               clip_cov: dict | None = None, correction: rollout_correction.Correction | None = None,
               distill: dict | None = None) -> dict[str, float]:
    """ppo_epochs x mini_batches optimizer steps on this rank's samples.

    Each micro-batch loss is normalised by the global mini-batch's token (or sequence) count and
    multiplied by world_size, so FSDP's gradient averaging yields the gradient of the global loss
    whatever the micro-batch size or the number of ranks. ``old_logp`` None means on-policy
    (one epoch, one mini-batch): the ratio's denominator is the current log-prob, detached.
    ``norm_len`` (the max response length) fixes seq-mean-token-sum-norm's divisor, which would
    otherwise be each micro-batch's own padded length. ``correction``: rollout correction's
    weights and the tokens it keeps (the others leave the loss and its normaliser). ``distill``:
    the top-k distillation term's options (the batch carries the teacher's top k).
    """
    mask = batch.response_mask().to(device)
    inp = UpdateInputs(adv.to(device), old_logp, ref_logp, batch.rollout_logp_matrix().to(device),
                       mask if correction is None else mask * correction.keep.to(device), temperature, world_size,
                       norm_len, tis_cap, clip_cov, None if correction is None else correction.weights,
                       distill if batch.teacher_topk is not None else None)
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
    if batch.staleness is not None:  # partial rollouts: tokens sampled this step vs by an older policy
        stale = _token_matrix(batch.staleness, mask).to(device)  # (N, T)
        for name, part in (("fresh", stale == 0), ("resumed", stale > 0)):
            split = mismatch_metrics(pre_update, inp.rollout_logp, mask * part)
            metrics.update({f"{k}_{name}": v for k, v in split.items()})
    return metrics


def _token_matrix(rows: list[list], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(like.shape)  # (N, T)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=out.dtype)
    return out


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
    sp = getattr(policy, "sp", None)  # Ulysses: each sample held by the group's U ranks
    agg = {"global_tokens": totals[0], "global_seqs": totals[1], "dp_size": inp.world_size,
           "norm_len": inp.norm_len, "copies": 1 if sp is None else sp.size}
    for idx in split_micro(batch, mini, cfg):
        _micro_step(policy, batch, idx, inp, cfg, agg, {} if sums is None else sums, record)


def _micro_step(policy, batch: RolloutBatch, idx: list[int], inp: UpdateInputs, cfg: AlgorithmConfig,
                agg: dict, sums: dict, record: torch.Tensor | None) -> None:
    sub = batch.select(idx)
    teacher = _teacher_topk(sub, inp.mask.device) if inp.distill is not None else None  # (n, t, k) ids, log-probs
    out = logprob_matrix(policy, sub, inp.temperature, grad=True, with_entropy=True, device=inp.mask.device,
                         topk_ids=None if teacher is None else teacher[0], **_pack_options(cfg))
    logp, ent = out[0], out[1]  # (n, t) each
    t = logp.shape[1]
    if record is not None:
        record[idx, :t] = logp.detach()
    mask, a = inp.mask[idx, :t], inp.adv[idx, :t]
    old = logp.detach() if inp.old_logp is None else inp.old_logp[idx, :t]
    is_weights = _token_weights(logp, old, idx, a, mask, inp, cfg, sums)
    pg_loss, pg_metrics = advantage.policy_loss(
        cfg.policy_loss, logp, old, a, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip_c=cfg.dual_clip_c, agg_mode=cfg.loss_agg_mode, is_weights=is_weights,
        tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg, **agg)
    loss = pg_loss
    ntok = mask.sum().item()
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * advantage.aggregate_loss(ent, mask, cfg.loss_agg_mode, **agg)
    if inp.ref_logp is not None:
        kl = advantage.kl_penalty(logp, inp.ref_logp[idx, :t], cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * advantage.aggregate_loss(kl, mask, cfg.loss_agg_mode, **agg)
        _add(sums, "actor/kl", (kl.detach() * mask).sum().item())
    if teacher is not None:  # GKD's divergence on the teacher's top k (+ tail) at every loss position
        d = inp.distill
        div = topk_divergence(d["divergence"], teacher[1], out[2], d["beta"])  # (n, t)
        loss = loss + d["coef"] * advantage.aggregate_loss(div, mask, cfg.loss_agg_mode, **agg)
        _add(sums, "distill/topk_divergence", (div.detach() * mask).sum().item())
    policy.backward(loss)
    _add(sums, "actor/pg_loss", pg_loss.item())
    _add(sums, "actor/entropy", (ent.detach() * mask).sum().item())
    _add(sums, "tokens", ntok)
    for k, v in pg_metrics.items():  # masked means over this micro-batch -> token-weighted sums
        _add(sums, k, v * ntok)


def _teacher_topk(sub: RolloutBatch, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's teacher top k as (n, t, k) ids and log-probs (padding: id 0, log-prob -inf)."""
    n, t = len(sub), sub.response_mask().shape[1]
    k = sub.teacher_topk[0][0].shape[1]
    ids, logp = torch.zeros(n, t, k, dtype=torch.int64), torch.full((n, t, k), float("-inf"))
    for i, (a, b) in enumerate(sub.teacher_topk):
        ids[i, : a.shape[0]], logp[i, : b.shape[0]] = a, b
    return ids.to(device), logp.to(device)


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
                   clip_cov: dict | None = None, correction: dict | None = None, distill: dict | None = None
                   ) -> dict[str, float]:
    """The train phase of one step: old and reference log-probs when needed, then the update
    (``tis_cap``: rollout_correction.tis_cap; ``clip_cov``: advantage.clip_cov_weights' ratio, low,
    high; ``correction``: RolloutCorrectionConfig.options(), which needs the old log-probs first;
    ``distill``: DistillConfig.loss_options(), the top-k term when the batch carries the teacher's top k).
    With ``algorithm.routing_replay: r2`` the old log-prob forward records each token's experts
    and every forward of the update replays them; with r3 every forward replays vLLM's."""
    batch, (adv,), _ = sp_group_batch(policy, batch, adv)  # Ulysses: the group's samples on each of its ranks
    on_policy = cfg.ppo_epochs == 1 and cfg.mini_batches == 1
    replay = {"r2": "record", "r3": "replay"}.get(cfg.routing_replay)
    rows = rollout_routing(batch) if cfg.routing_replay == "r3" else None
    no_grad = log_prob_micro(cfg)  # the no-gradient forwards' micro-batches (algorithm.log_prob_micro_*)
    if cfg.use_rollout_logprobs:  # vLLM's log-probs as the ratio's denominator: no recompute
        old = batch.rollout_logp_matrix().to(device)
    elif on_policy and correction is None and replay != "record":
        old = None
    else:
        with _routing(policy, replay, rows):
            old = compute_logprobs_in_chunks(policy, batch, temperature, no_grad, device, shared=True)
        rows = None  # loaded: the update replays the same
    ref_logp = None
    if ref is not None:
        with ref.on_device():  # an offloaded reference comes to the device once per step, not per micro-batch
            ref_logp = compute_logprobs_in_chunks(ref, batch, temperature, no_grad, device, shared=True)
    corr, extra = None, {}
    if correction is not None:
        corr, sums = rollout_correction.correct(old, batch.rollout_logp_matrix().to(device),
                                                batch.response_mask().to(device), **correction)
        w_max = all_reduce_max([sums.pop("w_max", 0.0)])[0]
        total = all_rank_sums(sums)
        extra = {**rollout_correction.summarise(total, w_max), **rollout_correction.batch_normalize(corr, total)}
    with _routing(policy, replay and "replay", rows):
        metrics = ppo_update(policy, batch, adv.to(device), old, ref_logp, cfg, temperature, world_size, device,
                             norm_len=norm_len, tis_cap=tis_cap, clip_cov=clip_cov, correction=corr,
                             distill=distill)
    if replay:
        extra.update(policy.routing_metrics())
    return {**metrics, **extra}


def _routing(policy, mode: str | None, rows: tuple | None = None):
    """The policy's routing-replay context for ``mode`` (R3's ``rows`` loaded first); nothing when None."""
    return contextlib.nullcontext() if mode is None else policy.routing(mode, rows)
