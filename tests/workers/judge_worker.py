"""Worker (torchrun, 2 ranks): judges on their own in-process vLLM engines beside the policy's.

Every rank: the policy's engine (tiny Qwen3), then a generative judge (another tiny Qwen3 with a
small chat template, a regex parser) and two discriminative ones (a tiny Qwen3ForSequenceClassification, a tiny
Qwen2ForRewardModel: vLLM's token-level reward head), built
as train_grpo.py builds them (rlcore.judge.build_judges). A fixed set of samples (with repeats) is
scored through rlcore.task.rewards.Scorer inside the phase switch's judging. Recorded per rank:

- the judge inputs (token ids), the generative judge's raw answers and parsed values, the reward
  model's values: the pytest side recomputes them with vllm.LLM alone and with transformers;
- what the policy's and the judges' engines hold in each phase (released sets, KV bytes);
- the policy's samples and log-probs of one seeded generate before building the judges and after
  the judging (woken by ensure_generation): equal when the judges leave the policy's engine alone.

    torchrun --nproc_per_node=2 tests/workers/judge_worker.py POLICY GEN_JUDGE RM QWEN2_RM OUT.json
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import sys

import torch

from rlcore.dist import all_gather_objects, init_distributed

RESPONSES = ["3 4", "7", "pick 2nd", "3 4", "9 9 9", "d", "7", "1st = 5"]
ROWS = [{"prompt": f"d {i} {i + 1} pick 1st =", "answer": str(i), "topic": "the"} for i in range(len(RESPONSES))]
ROWS[3] = ROWS[0]  # sample 3 repeats sample 0 exactly: one judge request for both


def config(policy: str, gen: str, rm: str, qrm: str):
    from rlcore.config import Config, DataConfig, ModelConfig, RewardConfig, RolloutConfig

    models = [
        {"name": "gen", "path": gen, "kind": "generative", "max_tokens": 6,  # the judge's chat template adds "ans is"
         "template": "{{ topic }} {{ prompt }} {{ response }}", "parser": r"(\d)", "parse_fail_value": -1.0,
         "max_model_len": 64, "kv_cache_gb": 0.03125},
        {"name": "rm", "path": rm, "kind": "discriminative", "max_model_len": 64, "kv_cache_gb": 0.03125},
        {"name": "qrm", "path": qrm, "kind": "discriminative", "max_model_len": 64, "kv_cache_gb": 0.03125},
    ]
    return Config(model=ModelConfig(path=policy, dtype="float32"), data=DataConfig(),
                  rollout=RolloutConfig(max_model_len=64, max_response_length=8, kv_cache_gb=0.0625, dtype="float32"),
                  reward=RewardConfig(components={"gen": 1.0, "rm": 0.5, "qrm": 0.25}, models=models))


def storage_ptrs(model) -> set[int]:
    from rlcore.rollout.cpu_sleep import model_storages

    params, buffers = model_storages(model)
    return {st.data_ptr() for st in [*params, *buffers]}


def policy_samples(rollout) -> list:
    out = rollout.generate([[3, 4, 5, 6], [7, 8, 9]], n=3, temperature=1.0, max_tokens=6, seed=11)
    return [(s.response_ids, s.logprobs) for group in out for s in group]


def storage_sleep(jcfg, info, prompts) -> dict:
    """The accelerators' judge sleep (rlcore.rollout.offload) on a real vLLM engine: in bfloat16 vLLM's
    CPU linear layers compute with the parameters' own storages (fp32 would repack them), so freeing
    and restoring those storages is what a GPU judge does."""
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.rollout import offload
    from rlcore.rollout.judge import JudgeEngine, rollout_kwargs

    rollout = ColocateRollout(jcfg.path, info, **rollout_kwargs(jcfg, "cpu", seed=0, dtype="bfloat16"))
    e = JudgeEngine(jcfg, rollout, offload="storage")
    model = e.rollout._model_runner().get_model()
    ref = e.generate(prompts, seed=1)
    out = {"storage_kv_gb_awake": e.kv_cache_gb()}
    e.sleep()  # level 1: weights to host memory
    out["storage_params_freed"] = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    out["storage_kv_gb_asleep"] = e.kv_cache_gb()
    e.wake()
    out["storage_level1_same"] = e.generate(prompts, seed=1) == ref
    e.sleep_level = 2
    e.sleep()  # level 2: weights discarded
    out["storage_level2_blocked"] = not e.rollout.weights_valid
    offload.restore(e._released)  # back without the reload: zeros, to show vLLM computes with these storages
    e._released, e.rollout.weights_valid = None, True
    out["storage_zeros_differ"] = e.generate(prompts, seed=1) != ref
    e.sleep()
    e.wake()  # reloaded from the judge's folder
    out["storage_level2_same"] = e.generate(prompts, seed=1) == ref
    e.shutdown()
    return out


def main() -> None:
    policy_dir, gen_dir, rm_dir, qrm_dir, out_path = sys.argv[1:6]
    info = init_distributed("cpu", 300)
    from rlcore import judge
    from rlcore.metrics import Timer
    from rlcore.rollout.checks import kv_zeroing_needed
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.step.switch import PhaseSwitcher
    from rlcore.task import rewards

    cfg = config(policy_dir, gen_dir, rm_dir, qrm_dir)
    rollout = ColocateRollout(policy_dir, info, seed=0, kv_cache_gb=0.0625, max_model_len=64)
    before = policy_samples(rollout)
    judges = judge.build_judges(cfg, info)
    m = {"judge_kv_gb_built": {n: j.engine.kv_cache_gb() for n, j in judges.items()},
         "kv_zeroing": {n: kv_zeroing_needed(j.engine.rollout.llm) for n, j in judges.items()},
         "has_zeroing_flag": hasattr(rollout.llm.llm_engine.engine_core.engine_core.scheduler,
                                     "needs_kv_cache_zeroing")}
    # F2: no judge computes with a tensor of the policy's engine (vLLM's process-global rotary cache)
    policy_ptrs = storage_ptrs(rollout.probe_module())
    m["storages_shared_with_policy"] = {n: len(policy_ptrs & storage_ptrs(j.engine.rollout.probe_module()))
                                        for n, j in judges.items()}
    timer = Timer()
    switch = PhaseSwitcher(None, rollout, timer, "cpu", offload_params=False, offload_optimizer=False,
                           free_kv_cache=True)
    scorer = rewards.Scorer(cfg.reward)
    scorer.attach_judges(judges, switch.judging, timer)
    inside = {}
    real_score = judges["rm"].score

    def spy(*args):  # what each engine holds while the judges score
        inside.update(policy_released=sorted(rollout.released),
                      judge_kv_gb={n: j.engine.kv_cache_gb() for n, j in judges.items()})
        return real_score(*args)

    judges["rm"].score = spy
    answers = [r["answer"] for r in ROWS]
    totals, correct, metrics = scorer.score_samples(RESPONSES, answers, rows=ROWS)
    m.update(inside=inside, after_policy_released=sorted(rollout.released),
             after_judge_kv_gb={n: j.engine.kv_cache_gb() for n, j in judges.items()},
             totals=totals, metrics=metrics, trace=[list(t) for t in switch.trace])
    m.update({f"{n}_inputs": [j.judge_ids(r, a, row) for r, a, row in zip(RESPONSES, answers, ROWS)]
              for n, j in judges.items()})
    m.update({f"{n}_raw": list(j.last_raw) for n, j in judges.items()})
    m.update({f"{n}_values": list(j.last_values) for n, j in judges.items()})
    switch.ensure_generation()
    m["resumed_trace"] = [list(t) for t in switch.trace]
    after = policy_samples(rollout)
    m["policy_same_ids"] = [a[0] for a in after] == [b[0] for b in before]
    m["policy_max_logprob_diff"] = max(abs(x - y) for a, b in zip(after, before) for x, y in zip(a[1], b[1]))
    m.update(storage_sleep(cfg.reward.judges()[0], info, m["gen_inputs"][:4]))
    judge.shutdown(judges, exiting=True)  # the worker ends next, as a run's teardown
    rollout.shutdown(exiting=True)
    ranks = all_gather_objects(m)
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump(ranks, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
