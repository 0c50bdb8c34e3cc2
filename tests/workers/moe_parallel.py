"""Worker (torchrun, 1 or 2 ranks): a tiny Qwen3-MoE through the real engine with expert
parallelism ``EP``: the logits of a fixed packed batch (every rank, no grad), the gradient of one
update's loss (each rank its share of the batch, shared prompts), the router metrics of the
step, and the exported HF weights. Rank 0 saves them.

    torchrun --nproc_per_node=W tests/workers/moe_parallel.py MODEL_DIR OUT.pt EP
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import sys

import torch

from rlcore.algo import grpo, packing
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed
from grad_invariance import global_batch  # this directory is on sys.path under torchrun


def main():
    model_dir, out, ep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    policy = VeOmniPolicy(model_dir, info, lr=1e-3, total_steps=1, grad_clip=None, ep_size=ep)
    batch, rewards = global_batch()
    packed = packing.pack(batch.prompt_ids, batch.response_ids, info.device, response_only=False)
    with torch.no_grad():
        logits = policy.model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                              use_cache=False).logits.float()
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(batch.response_mask().shape, generator=g) * batch.response_mask()
    per = len(batch) // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    local = batch.select(mine)
    t = local.response_mask().shape[1]
    cfg = AlgorithmConfig(share_prompt=True, micro_batch_size=2, entropy_coef=0.01)
    inp = grpo.UpdateInputs(adv[mine, :t], None, None, torch.zeros(per, t), local.response_mask(), 0.9,
                            info.world_size, norm_len=10)
    grpo.accumulate_gradients(policy, local, list(range(per)), inp, cfg)
    grads = {n: policy._whole(n, p.grad, None) for n, p in policy.model.named_parameters()}
    step = policy.step()
    weights = dict(policy.named_hf_weights())
    if info.rank == 0:
        torch.save({"logits": logits, "grads": grads, "step": step, "weights": weights,
                    "num_params": policy.num_params}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
