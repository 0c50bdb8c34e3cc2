"""Worker (torchrun, 1 rank): LoRA through the real engines on a tiny Qwen3.

1. Gradients: after one step (B no longer zero), the adapter's gradients of a simple loss on one
   packed row equal those of a hand-written LoRA on transformers' forward (base(x) + s * B(A(x))
   on every target layer, A and B leaf tensors copied from the engine).
2. Sync: ten steps, each followed by the adapter-only push into vLLM (LoRA engine); after each,
   vLLM samples and the trainer scores the samples: max |d log-prob|. Before the third push the
   adapter is deliberately left stale once: that step's difference is reported apart.
3. vLLM's base parameters after the ten pushes are bit-identical to those it loaded.
4. The merged export (checkpoint.merge_lora) in transformers, and in vLLM, scores like the trainer's adapter;
   a policy started from the exported adapter (lora.path) holds exactly its tensors.

    torchrun --nproc_per_node=1 tests/workers/lora_worker.py MODEL_DIR OUT.pt
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import os
import sys

import torch

from rlcore.config.lora import LoraConfig
from rlcore.dist import init_distributed

ROW = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def loss_of(logp: torch.Tensor) -> torch.Tensor:
    return -(logp * torch.linspace(-1.0, 1.5, logp.shape[-1])).sum()


def engine_grads(policy) -> tuple[dict, dict]:
    """The adapter's weights and the gradients of ``loss_of`` on ROW, whole, under PEFT names."""
    ids, pos, labels = torch.tensor([ROW[:-1]]), torch.arange(len(ROW) - 1)[None], torch.tensor([ROW[1:]])
    logp, _ = policy.forward_logprobs(ids, pos, labels, grad=True)
    policy.backward(loss_of(logp[0]))
    from rlcore.engine.lora import peft_name

    weights, grads = {}, {}
    for name, p in policy.model.named_parameters():
        if p.requires_grad:
            weights[peft_name(name)] = policy._whole(name, p, None).cpu().clone()
            grads[peft_name(name)] = policy._whole(name, p.grad, None).cpu().clone()
    return weights, grads


def reference_grads(model_dir: str, weights: dict, scaling: float) -> dict:
    """Hand-written LoRA on transformers: each target Linear computes base(x) + s * x A^T B^T."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    leaves = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
    for name, module in model.named_modules():
        key = f"base_model.model.{name}.lora_A.weight"
        if key in leaves:
            a, b = leaves[key], leaves[key.replace("lora_A", "lora_B")]
            module.forward = (lambda x, m=module, a=a, b=b: torch.nn.functional.linear(x, m.weight)
                              + scaling * (x @ a.T) @ b.T)
    logits = model(input_ids=torch.tensor([ROW[:-1]])).logits[0].float()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ROW[1:])[:, None])[:, 0]
    loss_of(logp).backward()
    return {n: t.grad for n, t in leaves.items()}


def sampled_diff(policy, rollout) -> float:
    """vLLM samples with the pushed adapter; the trainer scores the same tokens."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = rollout.generate(prompts, n=2, max_tokens=6, temperature=1.0, seed=3)
    worst = 0.0
    for p, samples in zip(prompts, out):
        for s in samples:
            ids = p + s.response_ids
            logp, _ = policy.forward_logprobs(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None],
                                              torch.tensor([ids[1:]]), grad=False)
            mine = logp[0, len(p) - 1:]
            worst = max(worst, (mine - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def merged_vs_adapter(policy, merged_dir: str) -> float:
    """transformers on the merged export vs the trainer with its adapter: max |d log-prob| on ROW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ROW[:-1]])).logits[0].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ROW[1:])[:, None])[:, 0]
    mine, _ = policy.forward_logprobs(torch.tensor([ROW[:-1]]), torch.arange(len(ROW) - 1)[None],
                                      torch.tensor([ROW[1:]]), grad=False)
    return (mine[0] - ref).abs().max().item()


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    from rlcore.engine_veomni import LoraPolicy
    from rlcore.colocate_rollout import ColocateRollout

    policy = LoraPolicy(model_dir, info, lora=LoraConfig(rank=8, alpha=16), lr=1e-2, total_steps=10, grad_clip=None)
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    optimizer_tensors = sum(len(g["params"]) for o in policy._inner_optimizers() for g in o.param_groups)
    engine_grads(policy)
    policy.step()  # B leaves zero: the gradient check below sees both factors at work
    policy.optimizer.zero_grad(set_to_none=True)
    weights, grads = engine_grads(policy)
    ref = reference_grads(model_dir, weights, policy.scaling)
    grad_diff = max((grads[n] - ref[n]).abs().max().item() for n in grads)
    grad_scale = max(ref[n].abs().max().item() for n in ref)
    policy.optimizer.zero_grad(set_to_none=True)

    rollout = ColocateRollout(model_dir, info, kv_cache_gb=0.0625, max_model_len=64, lora_rank=8)
    vllm_model = rollout._model_runner().get_model()
    base_before = {n: p.detach().clone() for n, p in vllm_model.named_parameters() if "lora" not in n}
    diffs, stale = [], None
    for step in range(10):
        logp, _ = policy.forward_logprobs(torch.tensor([ROW[:-1]]), torch.arange(len(ROW) - 1)[None],
                                          torch.tensor([ROW[1:]]), grad=True)
        policy.backward(loss_of(logp[0]) * (1 if step % 2 else -1))
        policy.step()
        policy.optimizer.zero_grad(set_to_none=True)
        if step == 2:  # the stale adapter: vLLM still holds step 1's
            stale = sampled_diff(policy, rollout)
        n, nbytes = rollout.update_adapter(policy.adapter_weights(), policy.adapter_config())
        diffs.append(sampled_diff(policy, rollout))
    changed = [n for n, p in vllm_model.named_parameters() if "lora" not in n and not torch.equal(p, base_before[n])]
    policy.merge_export = True
    policy.save_hf(out + ".hf")
    merged_diff = merged_vs_adapter(policy, out + ".hf/merged")
    # lora.path: a policy started from the exported adapter holds exactly its tensors
    again = LoraPolicy(model_dir, info, lora=LoraConfig(path=out + ".hf"), lr=1e-2, total_steps=1)
    exported = dict(policy.adapter_weights())
    restart_diff = max((t - exported[n]).abs().max().item() for n, t in again.adapter_weights())
    del again
    adapter_dir = rollout.lora_request.lora_path
    rollout.shutdown()  # vLLM on the merged export (a plain engine, no LoRA) samples like the trainer's adapter
    adapter_dir_left = os.path.exists(adapter_dir)  # the engine's /dev/shm folder goes with it
    rollout = ColocateRollout(out + ".hf/merged", info, kv_cache_gb=0.0625, max_model_len=64)
    merged_vllm_diff = sampled_diff(policy, rollout)
    torch.save({"grad_diff": grad_diff, "grad_scale": grad_scale, "trainable": trainable,
                "optimizer_tensors": optimizer_tensors, "diffs": diffs, "stale": stale, "pushed": (n, nbytes),
                "base_checked": len(base_before), "base_changed": changed, "merged_diff": merged_diff, "merged_vllm_diff": merged_vllm_diff, "restart_diff": restart_diff, "adapter_dir_left": adapter_dir_left,
                "adapter_files": sorted(os.listdir(out + ".hf"))}, out)
    rollout.shutdown()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
