"""Worker (torchrun): one GRPO training step, a weight sync into vLLM, then vLLM's log-probs of
its sampled tokens against the trainer's log-probs of the same tokens; the sync check
(rlcore.step.sync_check, warn mode) runs on the switch and its figures and verdict are reported.

    torchrun --nproc_per_node=2 tests/workers/sync_logprobs.py CASES_JSON

CASES_JSON lists the cases, run one after the other in this one launch (each builds its own policy
and engine and tears them down: the imports and the process group are the launch's only shared
state): ``[{"model": DIR, "tp": 1, "flags": [...], "out": RESULT_JSON}, ...]``. The cases of one
launch share VeOmni's parallel state, so they share one expert-parallel size.

Flags: ``no-tied-repack`` takes rlcore's CPU tied-head re-pack out (rlcore/rollout/cpu_repack.py), i.e. the
behaviour before the fix: the tests show the check catching it and naming the LM head. ``ep2``:
experts sharded by expert parallelism over both ranks. ``vs-transformers``: vLLM's log-probs after
the sync are also compared with transformers' forward of the trainer's exported weights.
``ascend-moe``: the engine runs under rollout.emulate_ascend_moe (emulated sleep level 2: the experts
in the NPU kernel's layout, swapped for transposed views at each wake-up and put back by the rollout:
rlcore/rollout/expert_layout.py); ``no-restore`` / ``keep-w2-swapped`` / ``keep-w13-swapped`` take
that restore out, whole or for one of the two weights (the behaviour before the fix), and
``expect-error`` reports the switch's error instead of failing the launch.
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import sys

import torch

from rlcore import advantage
from rlcore.algo import grpo
from rlcore.algo.batch import RolloutBatch
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed
from rlcore.metrics import Timer
from rlcore.step.switch import PhaseSwitcher
from rlcore.step.sync_check import SyncCheck


def sample(rollout, prompts, temperature, seed):
    out = rollout.generate(prompts, n=4, temperature=temperature, max_tokens=12, seed=seed)
    flat = [(p, s) for p, samples in zip(prompts, out) for s in samples]
    return RolloutBatch([p for p, _ in flat], [s.response_ids for _, s in flat],
                             [s.logprobs for _, s in flat], ["0"] * len(flat),
                             [s.finish_reason for _, s in flat], 4)


def max_diff(policy, rollout, batch, temperature, device):
    mask = batch.response_mask()
    trainer = grpo.compute_logprobs_in_chunks(policy, batch, temperature, 8, device).cpu()
    return ((trainer - batch.rollout_logp_matrix()).abs() * mask).max().item()


def transformers_diff(policy, batch, temperature, out) -> float:
    """Largest |vLLM - transformers| log-prob of ``batch``'s sampled tokens, transformers running
    the trainer's weights as exported (HF names, the checkpoint's expert layout); max over ranks."""
    import os

    from transformers import AutoModelForCausalLM

    from rlcore.dist import all_reduce_max, barrier

    hf_dir = os.path.join(os.path.dirname(out), "hf_export")
    policy.save_hf(hf_dir)
    barrier()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for p, r, lp in zip(batch.prompt_ids, batch.response_ids, batch.rollout_logp):
            ids = torch.tensor([p + r])
            logits = model(ids).logits[0, len(p) - 1: len(p) + len(r) - 1] / temperature
            ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(lp)).abs().max().item())
    return all_reduce_max([worst])[0]


RESTORED: list[int] = []  # what each ExpertParams.restore of the case put back


def sabotage_restore(flags: list[str]) -> None:
    """ExpertParams.restore as the case's flags have it: whole, or leaving some weights swapped."""
    from rlcore.rollout import expert_layout

    restore = RESTORE_FN.setdefault("fn", expert_layout.ExpertParams.restore)
    skip = {"no-restore": ("w13_weight", "w2_weight"), "keep-w2-swapped": ("w2_weight",),
            "keep-w13-swapped": ("w13_weight",)}
    skipped = {attr for flag in flags for attr in skip.get(flag, ())}

    def partial(self):
        kept = [k for k in self.kept if k[2] not in skipped]
        RESTORED.append(restore(expert_layout.ExpertParams(kept)))
        return RESTORED[-1]

    expert_layout.ExpertParams.restore = partial


RESTORE_FN: dict = {}


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    info = init_distributed("cpu")
    from rlcore.rollout import cpu_repack

    tied_linears = cpu_repack.cpu_tied_linears
    for case in cases:
        flags = case["flags"]
        cpu_repack.cpu_tied_linears = (lambda model: []) if "no-tied-repack" in flags else tied_linears
        sabotage_restore(flags)
        RESTORED.clear()
        run_case(info, case["model"], case["tp"], case["out"], flags)
        gc.collect()  # the case's policy and engine are gone before the next one builds
    torch.distributed.destroy_process_group()


def run_case(info, model_dir: str, tp: int, out: str, flags: list[str]) -> None:
    from rlcore.engine_veomni import VeOmniPolicy
    from rlcore.colocate_rollout import ColocateRollout

    torch.manual_seed(0)
    policy = VeOmniPolicy(model_dir, info, lr=1e-2, total_steps=10, ep_size=2 if "ep2" in flags else 1)
    ascend = dict(emulate_sleep=True, sleep_level=2, emulate_ascend_moe=True) if "ascend-moe" in flags else {}
    rollout = ColocateRollout(model_dir, info, tp_size=tp, seed=0, max_model_len=64, kv_cache_gb=0.1, **ascend)
    probe = [[13, 4 + i, 5, 6, 7, 14, 18, 15, 4, 5, 9, 7] for i in range(2)]
    checker = SyncCheck("warn", "float32", probe, info.device, is_main=info.is_main)
    timer = Timer()
    switch = PhaseSwitcher(policy, rollout, timer, "cpu", offload_params=True, offload_optimizer=True,
                           free_kv_cache=True, checker=checker)
    temperature = 0.8
    prompts = [[13, 4 + i, 5, 6, 7, 14, 18, 15] for i in range(4)]
    batch = sample(rollout, prompts, temperature, seed=1)
    before = max_diff(policy, rollout, batch, temperature, info.device)
    # One real GRPO step on made-up rewards (longer responses are better) so the weights move.
    rewards = torch.tensor([float(len(r)) for r in batch.response_ids])
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), 4)
    switch.to_training()
    metrics = grpo.ppo_update(policy, batch, adv, None, None, AlgorithmConfig(micro_batch_size=8), temperature,
                              info.world_size, info.device)
    try:
        switch.to_generation()
    except RuntimeError as e:  # every rank fails at the same layer: no collective is left waiting
        if "expect-error" not in flags:
            raise
        if info.rank == 0:
            json.dump({"error": f"{type(e).__name__}: {e}", "before": before, "restored": RESTORED}, open(out, "w"))
        rollout.shutdown()
        return
    check = {**switch.pop_metrics(), **timer.pop_metrics(), "breach": checker.last_breach}
    # How far the weights moved: the trainer's new log-probs of the first batch against vLLM's old
    # ones. A sync that did nothing would leave a difference of this size below.
    moved = max_diff(policy, rollout, batch, temperature, info.device)
    # The level-2 refill (accelerators: the weights' memory was discarded by the sleep): the next
    # full push must write every vLLM parameter (rollout.checks.require_all_loaded raises otherwise);
    # a tied head is the embedding's Parameter, so the embedding's tensor covers it.
    rollout.weights_valid = False
    with policy.on_device():
        refilled = rollout.update_weights(policy.named_hf_weights(fused_experts=bool(rollout.fused_experts)), full=True)
    after = sample(rollout, prompts, temperature, seed=2)
    diff = max_diff(policy, rollout, after, temperature, info.device)
    mask = after.response_mask()
    new_lp = grpo.compute_logprobs_in_chunks(policy, after, temperature, 8, info.device).cpu()
    vs_hf = transformers_diff(policy, after, temperature, out) if "vs-transformers" in flags else None
    if info.rank == 0:
        json.dump({"before": before, "after": diff, "moved": moved, "grad_norm": metrics["actor/grad_norm"],
                   "tokens": int(mask.sum().item()),
                   "mean_abs_logp": (new_lp.abs() * mask).sum().item() / mask.sum().item(),
                   "probe_max": check["rollout/sync_probe_max"], "probe_mean": check["rollout/sync_probe_mean"],
                   "breach": check["breach"], "check_s": check.get("timing/sync_check_s"),
                   "refilled": refilled, "valid": rollout.weights_valid, "after_vs_transformers": vs_hf,
                   "fused_experts": rollout.fused_experts,
                   "restored": RESTORED},
                  open(out, "w"))
    rollout.shutdown()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
