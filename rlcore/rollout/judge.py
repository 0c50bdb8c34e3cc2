"""A judge's in-process vLLM engine: a rollout engine (rlcore.colocate_rollout) that never gets
weight updates, asleep except while it scores.

Generative judges sample (greedy by default) through ``ColocateRollout.generate``; discriminative
ones run vLLM's pooling runner (``runner="pooling"``) and ``LLM.classify``: one forward per
sequence, the classification head at the last token (vllm 0.32 entrypoints/pooling/offline.py:241
``classify``; ``*ForSequenceClassification`` of a causal LM is converted by
model_executor/models/adapters.py ``as_seq_cls_model``). ``PoolingParams(use_activation=False)``
returns the head's raw value (vLLM's default applies a sigmoid to one-label heads).

Memory, ``sleep()`` after scoring and ``wake()`` before, by ``offload`` mode:
    storage  (accelerators) the engine is built without vLLM's sleep mode, which serves one engine
             per process (rlcore.rollout.offload), and eager; sleeping frees the storages of its
             weights (level 1: copied to host memory first; level 2: reloaded from the judge's
             folder at wake-up), buffers and KV cache.
    kv       (CPU) vLLM has no sleep mode on CPU and its fp32 linear weights live in oneDNN handles:
             the KV cache buffer is freed (ColocateRollout.release_memory), the weights stay.
             Under rollout.emulate_sleep a CPU judge sleeps in storage mode, as on a device.
Storage mode is refused for a judge whose KV blocks vLLM zeroes before use (hybrid Mamba / linear
attention models, mixed-precision caches: ``KVCacheConfig.needs_kv_cache_zeroing``, vllm 0.32.0
v1/kv_cache_interface.py:1586): its ``KVBlockZeroer`` precomputes the blocks' absolute addresses
(v1/worker/utils.py:122-175), which a freed and re-allocated storage no longer has.
"""

from __future__ import annotations

from rlcore.protocols import EngineSection
from rlcore.rollout.checks import kv_zeroing_needed


def default_offload(device_type: str, emulate_sleep: bool = False) -> str:
    """storage on accelerators and under rollout.emulate_sleep (the device's discipline on CPU), else kv."""
    return "kv" if device_type == "cpu" and not emulate_sleep else "storage"


def judge_llm_kwargs(cfg: EngineSection, device_type: str, *, seed: int, dtype: str, tp_size: int) -> dict:
    """The ``vllm.LLM`` keywords of a judge's engine (what ColocateRollout builds it with; the dry
    run, scripts/check_config.py, hands them to vLLM's EngineArgs)."""
    from rlcore.rollout.settings import llm_kwargs

    return llm_kwargs(cfg.path, device_type, tp_size=tp_size, seed=seed,
                      max_model_len=cfg.max_model_len, dtype=dtype, kv_cache_gb=cfg.kv_cache_gb,
                      gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=True, multimodal=False,
                      speed=dict(max_num_seqs=None, max_num_batched_tokens=None, enable_prefix_caching=None),
                      runner="generate" if cfg.generative else "pooling", sleep_mode=False)


def rollout_kwargs(cfg: EngineSection, device_type: str, *, seed: int, dtype: str, tp_size: int = 1,
                   **engine_kwargs) -> dict:
    """``ColocateRollout(cfg.path, info, **rollout_kwargs(...))``: a judge's engine, eager, without
    vLLM's sleep mode (``JudgeEngine`` sleeps it). ``tp_size``: the policy engine's (the only one an
    in-process engine can have; judge.config). ``engine_kwargs``: more ColocateRollout keywords (a
    vision-language teacher's image limit)."""
    return dict(tp_size=tp_size, seed=seed, max_model_len=cfg.max_model_len, dtype=dtype,
                kv_cache_gb=cfg.kv_cache_gb, gpu_memory_utilization=cfg.gpu_memory_utilization,
                sleep_level=1 if device_type != "cpu" else None, enforce_eager=True,
                runner="generate" if cfg.generative else "pooling", sleep_mode=False, **engine_kwargs)


class JudgeEngine:
    def __init__(self, cfg: EngineSection, rollout, *, offload: str | None = None):
        """``rollout``: the judge's ``ColocateRollout``, built with ``rollout_kwargs`` (the caller
        imports the engine module: this wing's parts never import it). Refused (and shut down) when
        its KV blocks cannot survive the storage sleep."""
        self.cfg, self.device_type = cfg, rollout.info.device_type
        self.offload = offload or default_offload(self.device_type)
        self.sleep_level = cfg.sleep_level or 1
        self._released: list | None = None  # storage mode: what sleep() freed
        self.rollout = rollout
        if self.offload == "storage" and kv_zeroing_needed(self.rollout.llm):
            self.rollout.shutdown()
            raise ValueError(f"reward.models[{cfg.name!r}]: {cfg.path} needs its KV-cache blocks zeroed before use "
                             "(hybrid Mamba / linear-attention layers or a mixed-precision cache), through addresses "
                             "vLLM computes once at build; the judge's sleep re-allocates its KV cache, so those "
                             "addresses would point at freed memory. Use a judge with plain attention layers")

    @property
    def asleep(self) -> bool:
        return self._released is not None if self.offload == "storage" else bool(self.rollout.released)

    def sleep(self) -> str:
        if self.offload == "kv":
            self.rollout.release_memory()
            return f"{self.cfg.name}: released {sorted(self.rollout.released)}"
        if self._released is not None:
            return f"{self.cfg.name}: asleep"
        from rlcore.rollout import offload

        model, keep = self.rollout._model_runner().get_model(), self.sleep_level == 1
        params = offload.distinct_storages(model.parameters())
        ptrs = {st.data_ptr() for st in params}
        buffers = [st for st in offload.distinct_storages(model.buffers()) if st.data_ptr() not in ptrs]
        self._released = (offload.release(params, keep) + offload.release(buffers, keep=True)
                          + offload.release(self._kv_storages(), keep=False))
        if not keep:
            self.rollout.weights_valid = False  # generate() refuses until wake() reloads them
        offload.empty_device_cache(self.device_type)
        gb = sum(r.nbytes for r in self._released) / 2**30
        return f"{self.cfg.name}: {gb:.2f} GiB freed (weights {'to host' if keep else 'discarded'}, KV cache)"

    def require_awake(self, what: str) -> None:
        """Refuse a call while asleep, before it reaches vLLM: in storage mode the engine's own
        ``released`` set stays empty (the storages are freed under it), and a request run on freed
        storages fails inside the engine and leaves it holding blocks."""
        if self.asleep:
            raise RuntimeError(f"{self.cfg.name}: {what}() while the engine is asleep; call wake() first")

    def wake(self) -> str:
        if not self.asleep:
            return f"{self.cfg.name}: awake"
        if self.offload == "kv":
            self.rollout.resume_memory()
            return f"{self.cfg.name}: woken"
        from rlcore.rollout import offload
        from rlcore.rollout.checks import reset_prefix_cache

        offload.restore(self._released)
        self._released = None
        reset_prefix_cache(self.rollout.llm)  # the KV blocks' contents are gone
        if not self.rollout.weights_valid:  # level 2 discarded them: the folder on disk holds them
            self.rollout.update_weights_from_path(self.cfg.path)
            return f"{self.cfg.name}: woken, weights reloaded from {self.cfg.path}"
        return f"{self.cfg.name}: woken"

    def _kv_storages(self) -> list:
        from rlcore.rollout.offload import distinct_storages

        def flat(x):
            return [t for item in x for t in flat(item)] if isinstance(x, (list, tuple)) else [x]

        return distinct_storages(flat(self.rollout._model_runner().kv_caches))

    def kv_cache_gb(self) -> float:
        """GiB the judge's KV cache holds now (0 while asleep)."""
        return sum(st.nbytes() for st in self._kv_storages()) / 2**30

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """The judge's answer (token ids) to each prompt."""
        c = self.cfg
        self.require_awake("generate")
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
        self.require_awake("classify")
        ro._require_awake("classify", {"weights", "kv_cache"})
        params = PoolingParams(use_activation=self.cfg.activation == "sigmoid")
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in sequences]
        with ro._engine_rng_scope():
            if "classify" in ro.llm.supported_tasks:
                return [float(o.outputs.probs[0]) for o in ro.llm.classify(prompts, pooling_params=params,
                                                                            use_tqdm=False)]
            outputs = ro.llm.encode(prompts, pooling_params=params, pooling_task="token_classify", use_tqdm=False)
        return [float(o.outputs.data[-1].reshape(-1)[0]) for o in outputs]

    def shutdown(self, exiting: bool = False) -> None:
        self.rollout.shutdown(exiting)
