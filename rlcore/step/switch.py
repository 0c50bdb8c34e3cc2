"""The phase machine: the one place that orders the switch between training and generation.

Every rank runs the same steps in the same order (several are collective):

    to_generation  (after the optimizer step)
      1 offload_optimizer  optimizer state -> host           frees room for vLLM's weights
      2 probe_trainer      trainer scores the sync probe      (rollout.check_sync; a few tokens)
      3 wake_weights       vLLM re-allocates its weights      (accelerators, after a sleep)
      4 sync_weights       bucketed FSDP2 gather -> vLLM      always every tensor (full sync)
      5 offload_params     trainer parameter shards -> host   only after they were exported
      6 wake_kv_cache      vLLM re-allocates its KV cache     last: the biggest allocation
      7 check_sync         vLLM scores the probe: equal?      warn or stop (rlcore/step/sync_check.py)
    to_training  (after generation)
      1 release_rollout    vLLM frees its KV cache (and its weights at sleep level 1/2)
      2 onload             trainer parameters and optimizer state -> device
    judging  (inside the generation phase, around model-based rewards; reward.models)
      1 release_rollout    the policy's vLLM sleeps as for training
      2 wake_judges        each judge's engine: weights (level 2: reloaded from disk), KV cache
      3 release_judges     after scoring: the judges sleep again (CPU: their KV buffers freed)
    The policy's engine stays asleep after judging: training needs it so; another generate in the
    same phase (a further dynamic-sampling round, validation) wakes it first (ensure_generation).

The order keeps the peak low: at no point do the optimizer state, the KV cache and two copies
of the weights sit on the device together. Each step is logged (logger ``rlcore.step.switch``, INFO;
``logging.switch_trace=true`` prints it) with what it did or why it was a no-op, and recorded in
``trace``; ``describe()`` gives the configured sequence in one line (printed at start-up).

Level-2 sleep discards vLLM's weights; the guarantee that they are never used before a full
push is two-fold: step 3 always pushes every tensor (``update_weights(full=True)``), and the
rollout itself refuses ``generate()`` until such a push has completed (``weights_valid``).

CPU: sleeping a CPU engine hangs it, so the rollout never calls sleep there; release_rollout frees
the KV cache buffer instead (and under rollout.emulate_sleep the weights, as sleep levels 1 and 2
do on a device: rlcore/rollout/cpu_sleep.py), and the offload steps are logged no-ops unless configured (moving
CPU tensors to the host moves nothing). The same sequence runs on every device.

Metrics (``pop_metrics``): time per kind of step through the shared timer (``timing/offload_s``,
``timing/wake_s``, ``timing/weight_sync_s``, ``timing/release_s``, ``timing/onload_s``; the
trainer adds ``timing/generate_s`` and ``timing/train_s``) and memory after each step and after
each phase of the loop: ``memory/{step}_allocated_gb`` / ``_reserved_gb`` / ``_peak_allocated_gb``
on accelerators, ``memory/{step}_rss_gb`` on CPU, with step one of the names above or
``generate`` / ``train`` (taken when the next switch starts); for a mixture-of-experts engine
whose weights slept, ``rollout/experts_restored``: the expert weights vLLM's wake-up had swapped for
views and the rollout put back (vllm-ascend 0.23: 2 per MoE layer; CUDA and CPU: 0); for every
mixture-of-experts sync, ``rollout/experts_fused``: 1 when the experts went as two fused tensors a layer
(vllm 0.32's loader takes them), 0 under per-expert names (vllm 0.23's Qwen3-MoE: rollout.expert_layout).
"""

from __future__ import annotations

import logging
import time

from contextlib import contextmanager

import torch

from rlcore.dist import memory_stats

log = logging.getLogger("rlcore.step.switch")

TO_GENERATION = ("offload_optimizer", "probe_trainer", "wake_weights", "sync_weights", "offload_params",
                 "wake_kv_cache", "check_sync")
TO_TRAINING = ("release_rollout", "onload")
TO_JUDGING = ("release_rollout", "wake_judges")
FROM_JUDGING = ("release_judges",)
RESUME_GENERATION = ("wake_weights", "wake_kv_cache")
TIMER_OF_STEP = {
    "offload_optimizer": "offload", "wake_weights": "wake", "sync_weights": "weight_sync",
    "offload_params": "offload", "wake_kv_cache": "wake", "release_rollout": "release", "onload": "onload",
    "probe_trainer": "sync_check", "check_sync": "sync_check", "wake_judges": "wake", "release_judges": "release",
}


class PhaseSwitcher:
    """Owns the switch between the two phases on one rank (see the module docstring).

    Args:
        policy: the trainer engine (``offload``, ``onload``, ``named_hf_weights[_bucketed]``).
        rollout: the vLLM wrapper (``release_memory``, ``resume_memory``, ``update_weights``,
            ``released``, ``weights_valid``).
        timer: ``rlcore.metrics.Timer`` shared with the training loop.
        offload_params, offload_optimizer: move them to host while generating.
        free_kv_cache: release vLLM's memory while training.
        rollout_dtype: dtype the weights are cast to before the gather (vLLM's dtype).
        sync_bucket_mb: bucket size of the weight sync; None: one collective per tensor.
        checker: ``rlcore.step.sync_check.SyncCheck`` (or None: no check).
    """

    def __init__(self, policy, rollout, timer, device_type: str, *, offload_params: bool,
                 offload_optimizer: bool, free_kv_cache: bool, rollout_dtype=None,
                 sync_bucket_mb: float | None = 64.0, rank: int = 0, checker=None):
        self.policy, self.rollout, self.timer = policy, rollout, timer
        self.device_type, self.rank = device_type, rank
        self.offload_params, self.offload_optimizer = offload_params, offload_optimizer
        self.free_kv_cache, self.rollout_dtype = free_kv_cache, rollout_dtype
        self.sync_bucket_mb = sync_bucket_mb
        self.checker = checker
        self.phase = "generation"  # a fresh engine holds the initial weights already
        self.memory: dict[str, float] = {}
        self.trace: list[tuple[str, str, str]] = []  # (transition, step, what it did), last switch
        self.checkpoints: list[tuple[str, str, list[str]]] = []  # (save/load, phase, vLLM released)
        self._judges: list = []  # those of the judging in progress
        self.all_judges: list = []  # every judge engine of the run (memory metrics)

    def describe(self) -> str:
        """The configured sequence in one line per transition (printed once at start-up)."""
        sync = "per-tensor" if self.sync_bucket_mb is None else f"{self.sync_bucket_mb:g} MiB buckets"
        level = getattr(self.rollout, "sleep_level", None)
        emulated = getattr(self.rollout, "emulate_sleep", False)
        release = ("KV cache buffer (CPU: no sleep mode)" if self.device_type == "cpu" and not emulated
                   else f"sleep level {level}{' (emulated on CPU)' if emulated else ''}") \
            if self.free_kv_cache else "nothing (rollout.free_kv_cache=false)"
        return (f"phase switch on {self.device_type}: to_generation = offload_optimizer"
                f"[{'on' if self.offload_optimizer else 'off'}] -> wake_weights -> sync_weights[{sync}, "
                f"{self.rollout_dtype or 'trainer dtype'}] -> offload_params[{'on' if self.offload_params else 'off'}]"
                f" -> wake_kv_cache -> check_sync[{self.checker.describe() if self.checker else 'off'}]; "
                f"to_training = release_rollout[{release}] -> onload")

    def trace_to_stderr(self) -> None:
        """Print every step of every switch (the ``rlcore.step.switch`` INFO records) on stderr."""
        if not any(getattr(h, "_rlcore_switch", False) for h in log.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[switch] %(message)s"))
            handler._rlcore_switch = True
            log.addHandler(handler)
        log.setLevel(logging.INFO)

    # ------------------------------------------------------------------------- transitions

    def to_generation(self) -> None:
        """Called after every optimizer step: guarantees a full weight push before generating."""
        if self.phase != "training":
            raise RuntimeError(f"to_generation() from phase {self.phase!r}; call to_training() first")
        self._record_memory("train")
        self._run("to_generation", TO_GENERATION)
        if not self.rollout.weights_valid:  # cannot happen after a full sync; never generate on garbage
            raise RuntimeError("vLLM weights are not valid after the weight sync")
        self.phase = "generation"

    def to_training(self) -> None:
        if self.phase != "generation":
            raise RuntimeError(f"to_training() from phase {self.phase!r}; call to_generation() first")
        self._record_memory("generate")
        self._run("to_training", TO_TRAINING)
        self.phase = "training"

    @contextmanager
    def judging(self, judges: list):
        """Around scoring with ``judges`` (rlcore.judge.scorer.Judge): the policy's engine sleeps,
        they wake; they sleep again after, whatever happened inside."""
        if self.phase != "generation":
            raise RuntimeError(f"judging from phase {self.phase!r}; judges score generated samples")
        self._judges = judges
        self.all_judges = list({id(j): j for j in [*self.all_judges, *judges]}.values())
        self._run("to_judging", TO_JUDGING)
        try:
            yield
        finally:
            self._run("from_judging", FROM_JUDGING)
            self._judges = []

    def ensure_generation(self) -> None:
        """Before a generate in the generation phase: wake the policy's engine if judging put it to
        sleep. Weights kept (CPU, level 1): wake them and the KV cache; discarded (level 2): the
        full round trip through training (onload, sync from the unchanged trainer, offload)."""
        if self.phase != "generation" or not self.rollout.released:
            return
        if self.rollout.weights_valid:
            self._run("resume_generation", RESUME_GENERATION)
        else:
            self.to_training()
            self.to_generation()

    def _run(self, transition: str, steps: tuple[str, ...]) -> None:
        self.trace = []
        for i, step in enumerate(steps, 1):
            start = time.perf_counter()
            with self.timer(TIMER_OF_STEP[step]):
                done = getattr(self, f"_{step}")()
            self._record_memory(step)
            self.trace.append((transition, step, done))
            log.info("rank %d %s %d/%d %s: %s (%.3f s)", self.rank, transition, i, len(steps), step, done,
                     time.perf_counter() - start)

    # ------------------------------------------------------------------------- steps

    def _offload_optimizer(self) -> str:
        if not self.offload_optimizer:
            return "no-op (offload.optimizer off)"
        self.policy.offload(params=False, optimizer=True)
        return "optimizer state to host"

    def _probe_trainer(self) -> str:
        return self.checker.before_sync(self.policy) if self.checker else "no-op (no sync check)"

    def _check_sync(self) -> str:
        return self.checker.after_sync(self.rollout) if self.checker else "no-op (no sync check)"

    def _wake_weights(self) -> str:
        if "weights" not in self.rollout.released:
            return "no-op (vLLM weights resident)"
        self.rollout.resume_memory(tags=["weights"])
        restored = getattr(self.rollout, "experts_restored", None)  # MoE (rlcore.rollout.expert_layout)
        if restored is None:
            return "vLLM weights re-allocated"
        self.memory["rollout/experts_restored"] = float(restored)
        return f"vLLM weights re-allocated; {restored} expert weights swapped by wake_up put back"

    def _sync_weights(self) -> str:
        if hasattr(self.policy, "adapter_weights"):  # LoRA: the adapter alone, vLLM's base stays
            n, nbytes = self.rollout.update_adapter(self.policy.adapter_weights(self.rollout_dtype),
                                                    self.policy.adapter_config())
            return f"LoRA adapter pushed: {n} tensors, {nbytes / 2**20:.2f} MiB; base weights untouched"
        fused = bool(self.rollout.fused_experts)  # MoE: 2 tensors a layer where the engine's loader takes them
        if self.rollout.fused_experts is not None:  # None: a dense model
            self.memory["rollout/experts_fused"] = float(fused)
        if self.sync_bucket_mb is None:
            n = self.rollout.update_weights(self.policy.named_hf_weights(dtype=self.rollout_dtype, fused_experts=fused),
                                            full=True)
            return f"{n} tensors pushed, one collective each"
        weights = self.policy.named_hf_weights_bucketed(dtype=self.rollout_dtype, bucket_mb=self.sync_bucket_mb,
                                                        fused_experts=fused)
        n = self.rollout.update_weights(weights, full=True)
        plan = self.policy.sync_plan_summary(dtype=self.rollout_dtype, bucket_mb=self.sync_bucket_mb)
        return f"{n} tensors pushed in {plan['buckets']} buckets (largest {plan['max_bucket_mb']:.1f} MiB)"

    def _offload_params(self) -> str:
        if not self.offload_params:
            return "no-op (offload.params off)"
        self.policy.offload(params=True, optimizer=False)
        return "parameter shards to host"

    def _wake_kv_cache(self) -> str:
        if "kv_cache" not in self.rollout.released:
            return "no-op (KV cache resident)"
        self.rollout.resume_memory(tags=["kv_cache"])
        return "KV cache re-allocated"

    def _release_rollout(self) -> str:
        if not self.free_kv_cache:
            return "no-op (rollout.free_kv_cache off)"
        self.rollout.release_memory()
        freed = sorted(self.rollout.released)
        return f"released {freed}" if freed else "no-op (nothing to release)"

    def _wake_judges(self) -> str:
        return "; ".join(j.engine.wake() for j in self._judges)

    def _release_judges(self) -> str:
        return "; ".join(j.engine.sleep() for j in self._judges)

    def _onload(self) -> str:
        if not (self.offload_params or self.offload_optimizer):
            return "no-op (nothing offloaded)"
        self.policy.onload(params=self.offload_params, optimizer=self.offload_optimizer)
        return f"to device: {'params ' if self.offload_params else ''}{'optimizer' if self.offload_optimizer else ''}".strip()

    def record_checkpoint(self, what: str) -> None:
        """Log a checkpoint save or load with the phase and what vLLM has released at that moment
        (``logging.switch_trace``; ``checkpoints`` keeps them): saves and loads run while vLLM sleeps."""
        released = sorted(self.rollout.released)
        self.checkpoints.append((what, self.phase, released))
        log.info("rank %d checkpoint %s: phase %s, vLLM released %s", self.rank, what, self.phase, released)

    # ------------------------------------------------------------------------- metrics

    def record_memory(self, phase: str) -> None:
        """Memory now, as ``memory/{phase}_*`` (e.g. ``teacher``: the distillation teacher awake)."""
        self._record_memory(phase)

    def _record_memory(self, phase: str) -> None:
        for key, value in memory_stats(self.device_type).items():
            self.memory[f"memory/{phase}_{key}"] = value
        held = [j.engine.kv_cache_gb() for j in self.all_judges]
        if held and None not in held:  # CPU: what the judges' KV caches hold after this step
            self.memory[f"memory/{phase}_judge_kv_gb"] = sum(held)
        accel = None if self.device_type == "cpu" else getattr(torch, self.device_type, None)
        if accel is not None:  # peak since the previous record: what this phase needed at most
            self.memory[f"memory/{phase}_peak_allocated_gb"] = accel.max_memory_allocated() / 2**30
            accel.reset_peak_memory_stats()

    def pop_metrics(self) -> dict[str, float]:
        out, self.memory = self.memory, {}
        if self.checker:
            out.update(self.checker.pop_metrics())
        return out
