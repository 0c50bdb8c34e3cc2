"""Worker (torchrun, 2 ranks): one update through the real FSDP2 engine on the trainer's fast path
(response-only logits, shared prompt), against an independent plain-PyTorch computation of the
same loss on rank 0.

The engine side is ``grpo.ppo_update`` with off-policy old log-probs, a reference model's KL,
an entropy bonus and truncated importance weights, exactly as the train phase calls it; the
gradient is read just before the optimizer step. The reference side loads the same checkpoint
with plain transformers (eager attention, one unpacked sequence at a time), takes the
log-probs and entropy from ``log_softmax`` of the full logits, and writes the loss out:

    ratio = exp(logp - old);  w = min(exp(old - rollout), cap)
    pg    = token_mean(w * max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)))
    loss  = pg - entropy_coef * token_mean(H) + kl_coef * token_mean(exp(ref - logp) - (ref - logp) - 1)

Rank 0 saves both gradients and both sets of metrics.

    torchrun --nproc_per_node=2 tests/workers/loss_reference.py MODEL_DIR OUT.pt
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import sys

import torch

from rlcore.algo import grpo
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed
from grad_invariance import global_batch, grad_vector  # this directory is on sys.path under torchrun

TEMPERATURE, CAP = 0.9, 1.5
CFG = AlgorithmConfig(loss_agg_mode="token-mean", policy_loss="vanilla", clip_low=0.2, clip_high=0.28,
                      entropy_coef=0.01, kl_loss_coef=0.1, kl_loss_type="k3", share_prompt=True,
                      micro_batch_size=2)


def inputs(policy, batch, device):
    """Advantages, old, ref and rollout log-probs (N, T) near the current ones, so clipping, KL and
    the TIS cap all act on some tokens."""
    cur = grpo.compute_logprobs_in_chunks(policy, batch, TEMPERATURE, 8, device)
    mask = batch.response_mask()
    g = torch.Generator().manual_seed(1)
    noise, noise2 = torch.randn(cur.shape, generator=g), torch.randn(cur.shape, generator=g)
    adv = torch.randn(cur.shape, generator=g) * mask
    old, ref, rollout = cur + 0.3 * noise * mask, cur - 0.2 * noise.abs() * mask, cur + 0.4 * noise2 * mask
    return adv, old, ref, rollout


def reference(model_dir, batch, adv, old, ref, rollout):
    """The loss and metrics in plain PyTorch on the whole batch; returns (grad vector, metrics)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    mask = batch.response_mask()  # (N, T)
    logp, ent = torch.zeros_like(mask), torch.zeros_like(mask)
    rows_lp, rows_h = [], []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        logits = model(torch.tensor([p + r])).logits[0].float() / TEMPERATURE  # (L, V)
        at = logits[len(p) - 1: len(p) - 1 + len(r)]  # the positions that predict the response
        lsm = torch.log_softmax(at, -1)
        rows_lp.append(lsm.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1))
        rows_h.append(-(lsm.exp() * lsm).sum(-1))
    logp = torch.nn.utils.rnn.pad_sequence(rows_lp, batch_first=True)
    ent = torch.nn.utils.rnn.pad_sequence(rows_h, batch_first=True)
    logp, ent = logp[:, : mask.shape[1]], ent[:, : mask.shape[1]]
    n = mask.sum()
    ratio = torch.exp(logp - old)
    w = torch.exp(old - rollout).clamp(max=CAP)
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CFG.clip_low, 1 + CFG.clip_high))
    pg = (w * per_tok * mask).sum() / n
    d = ref - logp
    kl = d.exp() - d - 1
    loss = pg - CFG.entropy_coef * (ent * mask).sum() / n + CFG.kl_loss_coef * (kl * mask).sum() / n
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    clipped = (-adv * ratio.clamp(1 - CFG.clip_low, 1 + CFG.clip_high) > -adv * ratio).float()
    metrics = {"actor/pg_loss": pg.item(), "actor/kl": ((kl * mask).sum() / n).item(),
               "actor/entropy": ((ent * mask).sum() / n).item(), "actor/clip_frac": ((clipped * mask).sum() / n).item(),
               "rollout/tis_clip_frac": (((old - rollout).exp() > CAP) * mask).sum().item() / n.item()}
    return grads, metrics


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    policy = VeOmniPolicy(model_dir, info, lr=1e-3, total_steps=1, grad_clip=None)
    batch, _ = global_batch()
    adv, old, ref, rollout = inputs(policy, batch, info.device)
    batch.rollout_logp = [rollout[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)]
    per = len(batch) // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    captured = []
    step = policy.step
    policy.step = lambda: (captured.append(grad_vector(policy)), step())[1]  # the gradient the step sees
    local = batch.select(mine)
    t = local.response_mask().shape[1]  # this rank's longest response, as the train phase has it
    metrics = grpo.ppo_update(policy, local, adv[mine, :t], old[mine, :t], ref[mine, :t], CFG, TEMPERATURE,
                              info.world_size, info.device, norm_len=10, tis_cap=CAP)
    if info.rank == 0:
        ref_grads, ref_metrics = reference(model_dir, batch, adv, old, ref, rollout)
        torch.save({"engine_grads": captured[0], "engine_metrics": metrics, "ref_grads": ref_grads,
                    "ref_metrics": ref_metrics}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
