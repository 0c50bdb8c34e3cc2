"""A judge's in-process vLLM engine: a rollout engine (rlcore.colocate_rollout) that never gets
weight updates, asleep except while it scores.

Generative judges sample (greedy by default) through ``ColocateRollout.generate``; discriminative
ones run vLLM's pooling runner (``runner="pooling"``) and ``LLM.classify``: one forward per
sequence, the classification head at the last token (vllm 0.32 entrypoints/pooling/offline.py:241
``classify``; ``*ForSequenceClassification`` of a causal LM is converted by
model_executor/models/adapters.py ``as_seq_cls_model``). ``PoolingParams(use_activation=False)``
returns the head's raw value (vLLM's default applies a sigmoid to one-label heads).

Memory: ``sleep()`` after scoring, ``wake()`` before. Accelerators use vLLM's sleep mode (level 1:
weights to host memory, level 2: discarded, reloaded from the judge's folder on wake-up); CPU has
no sleep mode, so the KV cache buffer is freed and the weights stay (ColocateRollout.release_memory).
"""

from __future__ import annotations

from rlcore.judge.config import JudgeConfig


def judge_llm_kwargs(cfg: JudgeConfig, device_type: str, *, seed: int, dtype: str) -> dict:
    """The ``vllm.LLM`` keywords of a judge's engine (what ColocateRollout builds it with; the dry
    run, scripts/check_config.py, hands them to vLLM's EngineArgs)."""
    from rlcore.colocate_rollout import llm_kwargs
    from rlcore.rollout_checks import pick_enforce_eager

    return llm_kwargs(cfg.path, device_type, tp_size=cfg.tensor_parallel_size or 1, seed=seed,
                      max_model_len=cfg.max_model_len, dtype=dtype, kv_cache_gb=cfg.kv_cache_gb,
                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                      enforce_eager=pick_enforce_eager(device_type, None), multimodal=False,
                      speed=dict(max_num_seqs=None, max_num_batched_tokens=None, enable_prefix_caching=None),
                      runner="generate" if cfg.generative else "pooling")


class JudgeEngine:
    def __init__(self, cfg: JudgeConfig, info, *, seed: int, dtype: str, device_type: str):
        from rlcore.colocate_rollout import ColocateRollout

        self.cfg, self.device_type = cfg, device_type
        self.sleep_level = cfg.sleep_level or 1
        self.rollout = ColocateRollout(
            cfg.path, info, tp_size=cfg.tensor_parallel_size or 1, seed=seed, max_model_len=cfg.max_model_len,
            dtype=dtype, kv_cache_gb=cfg.kv_cache_gb, gpu_memory_utilization=cfg.gpu_memory_utilization,
            sleep_level=self.sleep_level if device_type != "cpu" else None,
            runner="generate" if cfg.generative else "pooling")

    @property
    def asleep(self) -> bool:
        return bool(self.rollout.released)

    def sleep(self) -> str:
        self.rollout.release_memory()
        return f"{self.cfg.name}: released {sorted(self.rollout.released)}"

    def wake(self) -> str:
        if not self.rollout.released:
            return f"{self.cfg.name}: awake"
        self.rollout.resume_memory()
        if not self.rollout.weights_valid:  # level 2 discarded them: the folder on disk holds them
            self.rollout.update_weights_from_path(self.cfg.path)
            return f"{self.cfg.name}: woken, weights reloaded from {self.cfg.path}"
        return f"{self.cfg.name}: woken"

    def kv_cache_gb(self) -> float | None:
        """CPU: GiB the judge's KV cache holds now (0 while asleep); accelerators: None (the device
        memory metrics show what its sleep frees)."""
        if self.device_type != "cpu":
            return None
        from rlcore.cpu_kv import cpu_kv_bytes

        return cpu_kv_bytes(self.rollout._model_runner()) / 2**30

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """The judge's answer (token ids) to each prompt."""
        c = self.cfg
        out = self.rollout.generate(prompts, n=1, temperature=c.temperature, max_tokens=c.max_tokens, seed=seed)
        return [samples[0].response_ids for samples in out]

    def classify(self, sequences: list[list[int]]) -> list[float]:
        """The head's value (its first label) at each sequence's last token. A sequence
        classifier (``classify`` task) pools the last token itself; a token-level reward model
        (``token_classify``: Qwen2ForRewardModel, vllm 0.32 model_executor/models/qwen2_rm.py,
        pooler_for_token_classify) returns every token's value and the last one is the reward."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        ro = self.rollout
        ro._require_awake("classify", {"weights", "kv_cache"})
        params = PoolingParams(use_activation=self.cfg.activation == "sigmoid")
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in sequences]
        with ro._engine_rng_scope():
            if "classify" in ro.llm.supported_tasks:
                return [float(o.outputs.probs[0]) for o in ro.llm.classify(prompts, pooling_params=params,
                                                                            use_tqdm=False)]
            outputs = ro.llm.encode(prompts, pooling_params=params, pooling_task="token_classify", use_tqdm=False)
        return [float(o.outputs.data[-1].reshape(-1)[0]) for o in outputs]

    def shutdown(self) -> None:
        self.rollout.shutdown()
