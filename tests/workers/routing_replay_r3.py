"""Worker (torchrun, 1 or 2 ranks, EP = ranks): R3's trainer side through the real engine on a
tiny Qwen3-MoE. vLLM serves routed experts only where its V2 model runner runs (not on CPU:
rlcore.rollout.routing), so the rows come from an independent source in vLLM's exact format
(``CompletionOutput.routed_experts``: (P + R - 1, layers, K) uint8 per sample, the last sampled
token without a row): transformers' own Qwen3-MoE routing of each sequence, with every third
token's experts moved to other experts so that replay has something to change.

1. The rows go through ``packing.rollout_routing`` into the engine; a pre-hook on every experts
   module records the indices it is given in the replayed log-prob forward.
2. Reference: transformers' forward of each sequence alone with its routers forced to the rows
   (natively routed where a token has no row), which also counts the tokens whose native top-k
   (given the forced earlier layers) already was the row's set.
3. ``grpo.train_on_batch`` with ``routing_replay: r3`` (on-policy: the update is the only forward,
   at the same weights) reports the agreement of step 1.

    torchrun --nproc_per_node=W tests/workers/routing_replay_r3.py MODEL_DIR OUT.pt [ulysses=U]

With ``ulysses`` U > 1 (one Ulysses group over EP ranks): the ranks' samples and rows are gathered
first, as ``grpo.train_on_batch`` gathers them (``grpo.sp_group_batch``), so every check runs on
the group's batch, each rank routing its slice of every packed row.
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import dataclasses
import sys

import numpy as np
import torch

from rlcore.algo import grpo, packing
from rlcore.config import AlgorithmConfig
from rlcore.dist import all_reduce_max, all_reduce_sum, init_distributed
from grad_invariance import global_batch  # this directory is on sys.path under torchrun
from routing_replay import experts_capture, force_routers


def forced_forward(hf, batch, rows_of):
    """transformers' forward of every sequence alone, each router forced to ``rows_of[i]`` (P+R-1,
    L, K) at the positions it covers and native after. Returns (N, T) response log-probs and, per
    layer, [agreeing, covered] counts."""
    state, counts = {}, [[0, 0] for _ in hf.model.layers]

    def choose(layer, native):
        rows = torch.as_tensor(state["rows"][:, layer].astype(np.int64))  # (P+R-1, K)
        idx = native.clone()
        idx[: len(rows)] = rows
        same = (native[: len(rows)].sort(-1).values == rows.sort(-1).values).all(-1)
        counts[layer][0] += int(same.sum())
        counts[layer][1] += len(rows)
        return idx
    force_routers(hf, choose)
    out = torch.zeros(batch.response_mask().shape)
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        state["rows"] = rows_of[i]
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=torch.tensor([p + r])).logits[0].float(), -1)
        for t, tok in enumerate(r):
            out[i, t] = logp[len(p) - 1 + t, tok]
    return out, counts


def vllm_format_rows(hf, batch, num_experts, move=True):
    """Per sample the rows vLLM would return: transformers' native routing of prompt + response,
    (``move``) every third token moved to other experts, the last token cut, as uint8."""
    rows = []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + r]), output_router_logits=True).router_logits
        top = torch.stack([torch.topk(lg.softmax(-1), hf.config.num_experts_per_tok, -1).indices for lg in logits], 1)
        if move:
            top[::3] = (top[::3] + 1) % num_experts  # (P+R, L, K): a different set for those tokens
        rows.append(top[:-1].numpy().astype(np.uint8))
    return rows


SHARED = {"shared": False}  # under Ulysses: the batch is the group's already


def perturbed_routers(policy, hf, batch, rows, cfg, info):
    """A deliberate routing disagreement: the trainer's router weights (not the experts) moved by
    noise; the sampler is transformers at the original weights, its native routing the rows.
    Mean |trainer - sampler| log-prob over response tokens without and with replay, and the
    agreement; the router weights are restored exactly afterwards."""
    from rlcore.dist import all_reduce_sum

    sampler, _ = forced_forward(hf, batch, rows)  # forced to its own native routing: its plain forward
    g = torch.Generator().manual_seed(7 + info.rank)
    saved = []
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                local = p.to_local() if hasattr(p, "to_local") else p
                saved.append((local, local.clone()))
                local.add_(torch.randn(local.shape, generator=g) * 0.5 * local.std())
    plain = dict(cfg.__dict__, routing_replay=None)
    native = grpo.compute_logprobs_in_chunks(policy, batch, 1.0, AlgorithmConfig(**plain), info.device, **SHARED)
    with policy.routing("replay", packing.rollout_routing(dataclasses.replace(batch, routed_experts=rows))):
        replayed = grpo.compute_logprobs_in_chunks(policy, batch, 1.0, cfg, info.device, **SHARED)
    agreement = policy.routing_metrics()["actor/router_agreement"]
    with torch.no_grad():
        for local, copy in saved:
            local.copy_(copy)
    m = batch.response_mask()
    err_native, err_replay, n = all_reduce_sum([((native - sampler).abs() * m).sum().item(),
                                                ((replayed - sampler).abs() * m).sum().item(), m.sum().item()])
    return {"perturbed_agreement": agreement, "mismatch_without": err_native / n, "mismatch_with": err_replay / n}


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    ulysses = int(sys.argv[3].split("=")[1]) if len(sys.argv) > 3 else 1
    info = init_distributed("cpu")
    from transformers import Qwen3MoeForCausalLM

    from rlcore.engine_veomni import VeOmniPolicy

    world = info.world_size
    policy = VeOmniPolicy(model_dir, info, lr=1e-3, total_steps=1, grad_clip=None, ep_size=world,
                          routing_replay=True, ulysses_size=ulysses)
    hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch, _ = global_batch()
    per = len(batch) // world
    local = batch.select(list(range(info.rank * per, (info.rank + 1) * per)))
    local.routed_experts = vllm_format_rows(hf, local, hf.config.num_experts)
    native_rows = vllm_format_rows(hf, local, hf.config.num_experts, move=False)  # before forced_forward patches hf
    own, mine = local, list(range(len(local)))  # train_on_batch gathers the group itself
    if ulysses > 1:
        local, _, mine = grpo.sp_group_batch(policy, local)
        native_rows = _group_rows(native_rows, policy)
        SHARED["shared"] = True
    # a prompt copy per sample, as the reference scores them: equal agreement denominators
    cfg = AlgorithmConfig(share_prompt=False, micro_batch_size=2, routing_replay="r3")
    calls = experts_capture(policy.model, policy.replay)
    with policy.routing("replay", packing.rollout_routing(local)):
        replayed = grpo.compute_logprobs_in_chunks(policy, local, 1.0, cfg, info.device, **SHARED)
    first = policy.routing_metrics()
    # every token with a row reached the experts with exactly that row; the last tokens natively
    expected = {}
    for i, (p, r) in enumerate(zip(local.prompt_ids, local.response_ids)):
        for j in range(len(p) + len(r) - 1):
            key = packing.token_key(local.gids[i], j, prompt=True) if j < len(p) else packing.token_key(local.uids[i], j)
            expected[key] = local.routed_experts[i][j]
    mismatched = tokens = unreplayed = 0
    for layer, keys, idx in calls:
        for key, given in zip(keys.tolist(), idx):
            if key in expected:
                tokens += 1
                mismatched += int(not np.array_equal(given.numpy(), expected[key][layer].astype(np.int64)))
            else:
                unreplayed += 1
    ref, counts = forced_forward(hf, local, local.routed_experts)
    m = local.response_mask()
    diff = ((replayed - ref).abs() * m).max().item()
    disagreement = perturbed_routers(policy, hf, local, native_rows, cfg, info)
    # the train step: R3 end to end through grpo.train_on_batch (on-policy: one forward, same weights)
    adv = torch.randn(m.shape, generator=torch.Generator().manual_seed(1)) * m
    adv = adv[mine][:, : own.response_mask().shape[1]]  # this rank's own samples
    step = grpo.train_on_batch(policy, None, own, adv, cfg, 1.0, world, info.device, norm_len=10)
    agree_ref, covered_ref = all_reduce_sum([sum(c[0] for c in counts), sum(c[1] for c in counts)])
    mismatched, tokens, unreplayed = all_reduce_sum([mismatched, tokens, unreplayed])
    diff = all_reduce_max([diff])[0]
    if info.rank == 0:
        torch.save({"mismatched": mismatched, "tokens": tokens, "unreplayed": unreplayed, "diff_forced": diff,
                    "first": first, "step": {k: v for k, v in step.items() if "router" in k},
                    "agree_ref": agree_ref / covered_ref, "layers": len(counts), **disagreement}, out)
    torch.distributed.destroy_process_group()


def _group_rows(rows: list, policy) -> list:
    """The group's per-sample rows, rank by rank (the order ``sp_group_batch`` gives the samples)."""
    from rlcore.dist import all_gather_objects

    return [r for part in all_gather_objects(rows, policy.sp.group) for r in part]


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
