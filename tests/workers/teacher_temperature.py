"""Worker (torchrun, 1 rank): a bfloat16 distillation teacher's log-probs at a temperature, as the loop
asks for them (``TeacherEngine.token_logprobs``), and, as a control, the same engine with the
temperature folded into vLLM's ``LogitsProcessor.scale`` (what rlcore.rollout.teacher did before: a
multiply of the bf16 logits in place, vllm 0.32.0 model_executor/layers/logits_processor.py:117-118).
The pytest side (tests/test_distill.py) compares both with transformers' fp32 log_softmax(logits / T).

    torchrun --nproc_per_node=1 tests/workers/teacher_temperature.py TEACHER IN.json OUT.json
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import contextlib
import json
import sys

from rlcore.dist import init_distributed


@contextlib.contextmanager
def scale_in_head_dtype(model, temperature: float):
    """The control: 1/T multiplied into the head's bf16 logits by vLLM itself."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    heads = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    assert heads
    for m in heads:
        m.scale = m.scale / temperature
    try:
        yield
    finally:
        for m in heads:
            m.scale = 1.0


def main() -> None:
    teacher_dir, in_path, out_path = sys.argv[1:4]
    info = init_distributed("cpu", 300)
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.distill.config import DistillConfig
    from rlcore.rollout.judge import rollout_kwargs
    from rlcore.rollout.teacher import TeacherEngine

    with open(in_path) as f:
        job = json.load(f)
    sequences, temperature = job["sequences"], job["temperature"]
    d = DistillConfig(teacher=teacher_dir, max_model_len=65, kv_cache_gb=0.03125, temperature=temperature)
    rollout = ColocateRollout(teacher_dir, info, **rollout_kwargs(d, "cpu", seed=0, dtype="bfloat16"))
    e = TeacherEngine(d, rollout)
    out = {"teacher": e.token_logprobs(sequences, temperature=temperature),
           "t1": e.token_logprobs(sequences)}
    with scale_in_head_dtype(rollout.probe_module(), temperature):
        out["scaled_in_bf16"] = rollout.score(sequences)
    out["after_control_t1"] = e.token_logprobs(sequences)  # the hook and the control left nothing behind
    with open(out_path, "w") as f:
        json.dump(out, f)
    e.shutdown(exiting=True)


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
