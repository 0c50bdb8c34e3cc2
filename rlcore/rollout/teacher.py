"""A distillation teacher's in-process vLLM engine: a judge engine (rlcore.rollout.judge: built
beside the policy's, same TP group, asleep except while it scores, the device's sleep discipline)
that returns teacher-forced log-probs of the student's tokens.

One prefill per distinct sequence: ``SamplingParams(prompt_logprobs=0, max_tokens=1)`` gives the
log-prob of every prompt token after the first given those before it. vLLM computes them from
``model.compute_logits`` (V1 runner: v1/worker/gpu_model_runner.py:5374-5391, which the CPU runner
inherits; V2 runner on CUDA: v1/worker/gpu/model_runner.py:2150-2162, both vllm 0.32.0) as a raw
log-softmax, "prompt tokens skip sampling processors". A temperature T therefore goes in through
the model's ``LogitsProcessor.scale`` (model_executor/layers/logits_processor.py:116-119: logits *=
scale), set to 1/T around the call: the teacher engine never samples, and it is built eager
(rollout.judge.rollout_kwargs), so no captured graph keeps the old scale. A request with prompt
log-probs never reads the prefix cache (sampling_params.py:622-629): each sequence's every
position is computed.
"""

from __future__ import annotations

import contextlib

from rlcore.rollout.judge import JudgeEngine


@contextlib.contextmanager
def logit_scale(model, factor: float):
    """Multiply every ``LogitsProcessor.scale`` of ``model`` by ``factor`` inside the block."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    heads = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    if not heads:
        raise RuntimeError(f"{type(model).__name__} has no LogitsProcessor: cannot apply the teacher's temperature")
    before = [m.scale for m in heads]
    try:
        for m in heads:
            m.scale = m.scale * factor
        yield
    finally:
        for m, s in zip(heads, before):
            m.scale = s


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
        return logit_scale(self.rollout.probe_module(), 1.0 / temperature)
