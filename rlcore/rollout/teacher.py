"""A distillation teacher's in-process vLLM engine: a judge engine (rlcore.rollout.judge: built
beside the policy's, same TP group, asleep except while it scores, the device's sleep discipline)
that returns teacher-forced log-probs of the student's tokens.

One prefill per distinct sequence: ``SamplingParams(prompt_logprobs=0, max_tokens=1)`` gives the
log-prob of every prompt token after the first given those before it. vLLM computes them from
``model.compute_logits`` (V1 runner: v1/worker/gpu_model_runner.py:5374-5391, which the CPU runner
inherits; V2 runner on CUDA: v1/worker/gpu/model_runner.py:2150-2162, both vllm 0.32.0) as a raw
log-softmax, "prompt tokens skip sampling processors". A temperature T therefore goes in at the
model's ``LogitsProcessor``: a forward hook (``fp32_temperature``) casts its output, the head's
logits, to fp32 and divides by T there, as vLLM's sampler divides fp32 logits
(v1/sample/sampler.py:230-239) and as the student's fp32 log-probs are computed. Scaling
``LogitsProcessor.scale`` instead multiplies the head-dtype (bf16) logits in place
(model_executor/layers/logits_processor.py:117-118): one more bf16 rounding of l/T, up to ~0.1 nat at
|logit| 40 (tests/test_distill.py::test_teacher_temperature_is_applied_in_fp32). The hook runs after the
model's own scale and soft cap, on vllm 0.32 and 0.23 alike (both: ``forward`` of a plain
``nn.Module``, logits_processor.py:98-119 / 0.23.0 :54-73; vllm-ascend 0.23.0's AscendLogitsProcessor
subclasses it and overrides only ``_get_logits``, ops/vocab_parallel_embedding.py:285-341), and the
runners take fp32 logits as they are (V1 ``compute_logprobs``: log_softmax(dtype=float32),
v1/sample/sampler.py:308-309; V2 ``compute_topk_scores`` loads them into fp32,
v1/worker/gpu/sample/logprob.py:111-133). The teacher engine never samples, and it is built eager
(rollout.judge.rollout_kwargs), so no captured graph skips the hook. A request with prompt
log-probs never reads the prefix cache (sampling_params.py:622-629): each sequence's every
position is computed.
"""

from __future__ import annotations

import contextlib

import torch

from rlcore.rollout.judge import JudgeEngine


@contextlib.contextmanager
def fp32_temperature(model, temperature: float):
    """Inside the block every ``LogitsProcessor`` of ``model`` returns ``logits.float() / temperature``."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    heads = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    if not heads:
        raise RuntimeError(f"{type(model).__name__} has no LogitsProcessor: cannot apply the teacher's temperature")

    def divide(module, args, logits):
        return None if logits is None else logits.to(torch.float32) / temperature  # None: a TP rank without logits

    hooks = [m.register_forward_hook(divide) for m in heads]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


class TeacherEngine(JudgeEngine):
    """Teacher-forced log-probs of whole sequences at a temperature: per sequence, log p_teacher(x_t |
    x_<t) for t >= 1 from log_softmax(logits / temperature), and in top-k mode the k best tokens there."""

    def token_logprobs(self, sequences: list[list[int]], temperature: float = 1.0,
                       images: list | None = None) -> list[list[float]]:
        """``images``: per sequence its images or None (a vision-language teacher); the log-probs then
        follow the ids with the image tokens expanded, ending with the sequence's own last tokens."""
        self.require_awake("token_logprobs")
        with self._temperature(temperature):
            return self.rollout.score(sequences, images)

    def token_logprobs_topk(self, sequences: list[list[int]], k: int, temperature: float = 1.0,
                            images: list | None = None) -> list[tuple]:
        """Per sequence (its tokens' log-probs, [(k ids, k log-probs)] per position), as ColocateRollout.score_topk."""
        self.require_awake("token_logprobs_topk")
        with self._temperature(temperature):
            return self.rollout.score_topk(sequences, k, images)

    def _temperature(self, temperature: float):
        if temperature == 1.0:
            return contextlib.nullcontext()
        return fp32_temperature(self.rollout.probe_module(), temperature)
