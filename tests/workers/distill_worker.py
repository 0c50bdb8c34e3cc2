"""Worker (torchrun, 1 rank): a distillation teacher beside the policy's engine, built as train_grpo.py
builds it (rlcore.distill.build_teacher), scoring samples the policy's engine drew through the
loop's own code (rlcore.distill.teacher.Teacher, inside the phase switch's scoring context).
Recorded for the pytest side (tests/test_distill.py), which recomputes the log-probs with vllm.LLM
alone and with transformers:

- the samples (prompt, response, vLLM's log-probs), the teacher's log-probs at temperature 1 and
  0.7, the advantage and distill/* metrics with reward_weight 0.5 beside a given reward advantage;
- what each engine holds while the teacher scores and after (the policy's engine released, the
  teacher's KV cache back to 0), and the policy's samples before and after (woken by ensure_generation);
- top-k mode: the teacher's 5 best tokens and their log-probs at each response position, and the
  distill/topk_mass metric;
- multi-turn: with an environment mask, tokens the environment wrote get no distillation signal;
- the device's sleep discipline on a second, bfloat16 teacher (offload "storage", sleep level 2: its
  weights' storages freed and discarded, scoring refused while asleep, reloaded from its folder at
  wake-up, the same log-probs after).

    torchrun --nproc_per_node=1 tests/workers/distill_worker.py POLICY TEACHER OUT.json
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import dataclasses
import json
import sys

import torch

from rlcore.dist import init_distributed

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [3, 4, 5, 6]]  # the third repeats the first: dedup across groups


def batch_of(rollout, seed: int):
    """Nine samples and two exact repeats of the first two (one teacher request each)."""
    from rlcore.algo.batch import RolloutBatch, concat

    out = rollout.generate(PROMPTS, n=3, temperature=1.0, max_tokens=6, seed=seed)
    flat = [(p, s) for p, group in zip(PROMPTS, out) for s in group]
    batch = RolloutBatch(prompt_ids=[list(p) for p, _ in flat], response_ids=[s.response_ids for _, s in flat],
                         rollout_logp=[s.logprobs for _, s in flat], answers=[""] * len(flat),
                         finish_reasons=[s.finish_reason for _, s in flat], group_size=3)
    return concat([batch, batch.select([0, 1])])


def storage_discipline(cfg, info, sequences) -> dict:
    """The accelerators' teacher sleep on a real engine (bfloat16: vLLM's CPU linear layers then compute
    with the parameters' own storages, so freeing them is what a GPU teacher's sleep does)."""
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.rollout.judge import rollout_kwargs
    from rlcore.rollout.teacher import TeacherEngine

    d = dataclasses.replace(cfg.distill, sleep_level=2)
    rollout = ColocateRollout(d.path, info, **rollout_kwargs(d, "cpu", seed=0, dtype="bfloat16"))
    e = TeacherEngine(d, rollout, offload="storage")
    model = e.rollout.probe_module()
    ref = e.token_logprobs(sequences)
    e.sleep()
    out = {"storage_params_freed": all(p.untyped_storage().nbytes() == 0 for p in model.parameters()),
           "storage_weights_invalid": not e.rollout.weights_valid, "storage_kv_gb_asleep": e.kv_cache_gb()}
    try:
        e.token_logprobs(sequences)
        out["storage_refused_asleep"] = False
    except RuntimeError:
        out["storage_refused_asleep"] = True
    out["storage_wake"] = e.wake()
    out["storage_same_after_reload"] = e.token_logprobs(sequences) == ref
    e.shutdown()
    return out


def main() -> None:
    policy_dir, teacher_dir, out_path = sys.argv[1:4]
    info = init_distributed("cpu", 300)
    from rlcore import distill
    from rlcore.config import Config, ModelConfig, RolloutConfig
    from rlcore.distill.config import DistillConfig
    from rlcore.metrics import Timer
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.step.switch import PhaseSwitcher

    cfg = Config(model=ModelConfig(path=policy_dir, dtype="float32"),
                 rollout=RolloutConfig(max_model_len=64, max_response_length=6, kv_cache_gb=0.0625, dtype="float32"),
                 distill=DistillConfig(teacher=teacher_dir, max_model_len=65, kv_cache_gb=0.03125, temperature=1.0,
                                       reward_weight=0.5, coef=2.0))
    rollout = ColocateRollout(policy_dir, info, seed=0, kv_cache_gb=0.0625, max_model_len=64)
    batch = batch_of(rollout, seed=11)
    timer = Timer()
    switch = PhaseSwitcher(None, rollout, timer, "cpu", offload_params=False, offload_optimizer=False,
                           free_kv_cache=True)
    teacher = distill.build_teacher(cfg, info, rollout, switch, timer)
    m = {"teacher_kv_gb_built": teacher.engine.kv_cache_gb(), "policy_released_built": sorted(rollout.released)}
    inside, real = {}, teacher.engine.token_logprobs

    def spy(*args):  # what each engine holds while the teacher scores
        inside.update(policy_released=sorted(rollout.released), teacher_kv_gb=teacher.engine.kv_cache_gb())
        return real(*args)

    teacher.engine.token_logprobs = spy
    logp1, counts = teacher.logprobs(batch)
    m.update(inside=inside, trace=[list(t) for t in switch.trace], counts=counts,
             after_policy_released=sorted(rollout.released), after_teacher_kv_gb=teacher.engine.kv_cache_gb())
    teacher.temperature = 0.7
    logp07, _ = teacher.logprobs(batch)
    teacher.temperature = 1.0
    reward_adv = torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask()  # (N, T)
    adv, metrics = teacher.advantages(batch, reward_adv)
    m.update(prompts=batch.prompt_ids, responses=batch.response_ids, rollout_logp=batch.rollout_logp,
             teacher_logp=logp1.tolist(), teacher_logp_t07=logp07.tolist(), reward_adv=reward_adv.tolist(),
             adv=adv.tolist(), metrics=metrics, memory=switch.pop_metrics(), timing=timer.pop_metrics())
    topk_cfg = dataclasses.replace(teacher.cfg, mode="topk", topk=5)
    teacher.cfg, plain_cfg = topk_cfg, teacher.cfg
    _, topk_metrics = teacher.advantages(batch, torch.zeros_like(reward_adv))
    m.update(topk_ids=[a.tolist() for a, _ in batch.teacher_topk], topk_logp=[b.tolist() for _, b in batch.teacher_topk],
             topk_metrics=topk_metrics)
    teacher.cfg = plain_cfg
    env = batch.select(list(range(len(batch))))  # a copy; tokens 1 and 2 of every response came from a tool
    env.env_mask = [[0 if j in (1, 2) else 1 for j in range(len(r))] for r in env.response_ids]
    env_adv, _ = teacher.advantages(env, torch.zeros_like(reward_adv))
    m["env_adv"] = env_adv.tolist()
    switch.ensure_generation()
    again = batch_of(rollout, seed=11)
    m["policy_same_after"] = (again.response_ids == batch.response_ids and again.rollout_logp == batch.rollout_logp)
    sequences = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)][:4]
    m.update(storage_discipline(cfg, info, sequences))
    distill.shutdown(teacher, exiting=True)  # the worker ends next, as a run's teardown
    rollout.shutdown(exiting=True)
    with open(out_path, "w") as f:
        json.dump(m, f)


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
