"""Worker (torchrun, 1 or 2 ranks, EP = ranks): R2 routing replay through the real engine on a
tiny Qwen3-MoE, with VeOmni's own replay hook.

1. The old log-prob forward records each token's experts (shared prompts, micro-batches of 2).
2. One optimizer step with a large learning rate moves the routers.
3. The same samples go through again packed differently (a prompt copy per sample, micro-batches
   of 3) with replay on; a pre-hook on every experts module records the indices it is given.
4. transformers' own Qwen3-MoE with the engine's exported weights, its routers forced to the
   recorded experts (the router's softmax, gather, renorm and cast, as transformers computes
   them), scores each sequence alone: the reference for the replayed log-probs.

Rank 0 saves the figures; every rank's numbers are reduced first.

    torchrun --nproc_per_node=W tests/workers/routing_replay.py MODEL_DIR OUT.pt
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import dataclasses
import sys

import torch
import torch.nn.functional as F

from rlcore.algo import grpo, packing
from rlcore.config import AlgorithmConfig
from rlcore.dist import all_reduce_max, all_reduce_sum, init_distributed
from grad_invariance import global_batch  # this directory is on sys.path under torchrun


def experts_capture(model, replay):
    """Pre-hooks on every experts module: (layer, token keys, indices given) per call."""
    calls = []
    blocks = [m for _, m in model.named_modules() if type(m).__name__.endswith("SparseMoeBlock")]
    for layer, block in enumerate(blocks):
        def hook(_module, args, layer=layer):
            if replay.mode == "replay":
                calls.append((layer, replay.keys.clone(), args[1].detach().clone()))
        block.experts.register_forward_pre_hook(hook)
    return calls


def force_routers(model, choose):
    """transformers' Qwen3-MoE routers route each token to ``choose(layer, native)`` ((T, K), given
    the router's own top-k), with the router's own math at those indices (softmax, gather, renorm,
    cast)."""
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate

        def forward(hidden, gate=gate, layer=layer):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden, gate.weight)
            probs = F.softmax(logits, dtype=torch.float, dim=-1)
            idx = choose(layer, torch.topk(probs, gate.top_k, dim=-1).indices).to(logits.device)
            top = probs.gather(1, idx)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        gate.forward = forward


def reference_logprobs(hf_dir, batch, forced):
    """Per sequence, transformers' forward of prompt + response alone with every router forced to
    ``forced(layer, keys)``; log-probs of the response tokens, (N, T)."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = {}
    force_routers(model, lambda layer, native: forced(layer, state["keys"]))
    out = torch.zeros(batch.response_mask().shape)
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        state["keys"] = torch.tensor([packing.token_key(batch.gids[i], j, prompt=True) for j in range(len(p))]
                                     + [packing.token_key(batch.uids[i], j) for j in range(len(p), len(p) + len(r))])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        for t, tok in enumerate(r):
            out[i, t] = logp[len(p) - 1 + t, tok]
    return out


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    world = info.world_size
    policy = VeOmniPolicy(model_dir, info, lr=0.3, total_steps=1, grad_clip=None, ep_size=world,
                          routing_replay=True)
    replay = policy.replay
    batch, _ = global_batch()
    per = len(batch) // world
    local = batch.select(list(range(info.rank * per, (info.rank + 1) * per)))
    record_cfg = AlgorithmConfig(share_prompt=True, micro_batch_size=2, ppo_epochs=2, routing_replay="r2")
    with policy.routing("record"):
        grpo.compute_logprobs_in_chunks(policy, local, 1.0, record_cfg, info.device)
    # one step far from the old policy: the routers move
    g = torch.Generator().manual_seed(3)
    mask = local.response_mask()
    inp = grpo.UpdateInputs(torch.randn(mask.shape, generator=g) * mask, None, None, torch.zeros(mask.shape), mask,
                            1.0, world, norm_len=10)
    grpo.accumulate_gradients(policy, local, list(range(per)), inp, dataclasses.replace(record_cfg, routing_replay=None))
    policy.step()
    other = dataclasses.replace(record_cfg, share_prompt=False, micro_batch_size=3)
    calls = experts_capture(policy.model, replay)
    with policy.routing("replay"):
        replayed = grpo.compute_logprobs_in_chunks(policy, local, 1.0, other, info.device)
    used = list(calls)
    routing = policy.routing_metrics()
    native = grpo.compute_logprobs_in_chunks(policy, local, 1.0, dataclasses.replace(other, routing_replay=None),
                                             info.device)
    # every token the experts saw under replay got exactly the recorded indices
    mismatched = sum(int((idx != replay.indices(layer, keys)).any(-1).sum()) for layer, keys, idx in used)
    tokens = sum(len(keys) for _, keys, _ in used)
    hf_dir = out + ".hf"
    policy.save_hf(hf_dir)  # collective; rank 0 writes, then a barrier
    ref_forced = reference_logprobs(hf_dir, local, lambda layer, keys: replay.indices(layer, keys))
    m = local.response_mask()
    diff_forced = ((replayed - ref_forced).abs() * m).max().item()
    replay_effect = ((replayed - native).abs() * m).max().item()
    mismatched, tokens = all_reduce_sum([mismatched, tokens])
    diff_forced, replay_effect = all_reduce_max([diff_forced, replay_effect])
    if info.rank == 0:
        torch.save({"mismatched": mismatched, "tokens": tokens, "diff_forced": diff_forced,
                    "replay_effect": replay_effect, "routing": routing, "layers": len(replay.layer_of)}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
