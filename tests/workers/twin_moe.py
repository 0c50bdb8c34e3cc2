"""Worker (1 CPU rank): how the installed vLLM's loader takes a Qwen3-MoE's experts (issue 66, F1) and
its CPU experts forward on the path an AMX host takes.

    torchrun --nproc_per_node=1 tests/workers/twin_moe.py MODEL_DIR OUT_DIR

Three engines in turn on the tiny Qwen3-MoE (per-expert checkpoint names); the pushed weights are the
checkpoint's plus noise, written as an HF folder that transformers' forward is the reference of:
``probed``: the rollout's own choice (``ColocateRollout.fused_experts``), pushed in that layout;
``forced_fused``: the experts pushed fused whatever the loader takes (the sync before the fix);
``amx``: (vllm 0.23 only) the experts on the CPU kernel's torch path, which an AMX host takes for any
float32 MoE (cpu_fused_moe.py:302-313), then a push; then vLLM's own activation put back
(rlcore.rollout.cpu_moe replaced it) for one more ``llm.generate``. Writes OUT_DIR/results.json.
"""

import gc

gc.disable()  # a short-lived worker (rlcore.heap)

import json
import os
import shutil
import sys

import torch

PROMPTS = [[13, 4 + i, 5, 6, 7, 14, 18, 15] for i in range(3)]


def perturbed(model_dir: str, out: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus N(0, 0.05^2) noise, also saved as an HF folder at ``out``."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    w = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in
         load_file(os.path.join(model_dir, "model.safetensors")).items()}
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return w


def fused(w: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The experts as VeOmni holds them and the sync sends them fused: gate_up_proj (E, 2I, H), gate rows
    first; down_proj (E, H, I) (rlcore.engine.moe.split_experts' inverse)."""
    out, experts = [], {}
    for name, t in w.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out.append((name, t))
            continue
        e, kind = tail.split(".")[:2]
        experts.setdefault(head + sep, {}).setdefault(kind, {})[int(e)] = t
    for prefix, kinds in experts.items():
        n = len(kinds["down_proj"])
        out.append((prefix + "gate_up_proj", torch.stack([torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]])
                                                          for e in range(n)])))
        out.append((prefix + "down_proj", torch.stack([kinds["down_proj"][e] for e in range(n)])))
    return out


def gap(rollout, hf_dir: str) -> float:
    """Largest |vLLM - transformers| log-prob of vLLM's sampled tokens (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst = 0.0
    for p, samples in zip(PROMPTS, rollout.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8, seed=1)):
        for s in samples:
            with torch.no_grad():
                logits = model(torch.tensor([p + s.response_ids])).logits[0, len(p) - 1: len(p) + len(s.response_ids) - 1]
            ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def engine(model_dir, info):
    from rlcore.colocate_rollout import ColocateRollout

    return ColocateRollout(model_dir, info, tp_size=1, seed=0, max_model_len=64, kv_cache_gb=0.1)


def cpu_experts():
    """vllm 0.23's CPU experts module and its own SiLU entry, before any engine is built (None, None
    where the module is another vLLM's)."""
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    except ImportError:
        return None, None
    return cpu_fused_moe, cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU]


def main(model_dir: str, out_dir: str) -> None:
    from rlcore.dist import init_distributed

    info = init_distributed("cpu")
    cpu_fused_moe, vllm_silu = cpu_experts()
    hf = os.path.join(out_dir, "perturbed")
    w = perturbed(model_dir, hf)
    res = {}
    r = engine(model_dir, info)
    res["fused_experts"] = r.fused_experts
    res["pushed"] = r.update_weights(fused(w) if r.fused_experts else list(w.items()), full=True)
    res["gap"] = gap(r, hf)
    r.shutdown()

    r = engine(model_dir, info)
    try:
        res["forced_fused"] = {"pushed": r.update_weights(fused(w), full=True), "gap": gap(r, hf)}
    except RuntimeError as e:
        res["forced_fused"] = {"error": str(e)}
    r.shutdown()

    res["amx"] = None
    if cpu_fused_moe is not None:
        cpu_fused_moe.CPUFusedMOE.check_grouped_gemm = lambda self, layer: (False, "none")  # :302-313 on AMX
        r = engine(model_dir, info)
        res["amx"] = {"stale_gap": gap(r, hf)}  # the checkpoint's weights against the perturbed reference
        r.update_weights(list(w.items()), full=True)
        res["amx"]["gap"] = gap(r, hf)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU] = vllm_silu  # vLLM's own lambda again
        try:
            r.llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], SamplingParams(max_tokens=2), use_tqdm=False)
            res["amx"]["vllms_own"] = "ok"
        except AssertionError as e:
            res["amx"]["vllms_own"] = str(e)
        r.shutdown()
    import vllm

    res["vllm"] = vllm.__version__
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(lambda: main(sys.argv[1], sys.argv[2]))
