"""The checks and call-time helpers behind ``rlcore.colocate_rollout``, against the engine it built
(the pre-build choices, ``pick_*`` and the ``LLM`` keywords, are in ``rlcore.rollout.settings``).

Each helper takes plain values or the vLLM objects as arguments (a few import a vLLM name inside the
function: its config context, its greedy threshold, its prompt type), so the logic is unit-tested
with small fakes (tests/test_rollout_accel.py) while the code paths that only run on
accelerators stay checked against the pinned packages' sources, cited by file:line:
  vllm 0.32.0 (CUDA wheel), vllm 0.23.0 + vllm-ascend 0.23.0 (requirements-npu.txt pin),
  vllm 0.26.0 + vllm-ascend 0.26.0rc1 (an earlier candidate). docs/accelerators.md has the table.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the detached weights are torch tensors
    import torch

log = logging.getLogger("rlcore.rollout")


def image_token_id(hf_config) -> int | None:
    """The id of the placeholder token one image is written as in a prompt (``<|image_pad|>`` for
    Qwen-VL: ``image_token_id``; ``image_token_index`` in LLaVA-style configs); None if none."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def slot_token_ids(hf_config) -> list[int]:
    """Token ids that mark image / video slots in a prompt (``<|image_pad|>``, ``<|video_pad|>``).
    A response must not contain them: the policy's forward takes every such token of its packed
    row for a slot to fill with vision features, so ``generate`` stops a sample at one (it ends
    the response, and ``rlcore.algo.packing.pack`` never feeds a response's last token as an input)."""
    ids = [image_token_id(hf_config)]
    for key in ("video_token_id", "video_token_index"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            ids.append(value)
            break
    return [i for i in ids if i is not None]


def check_prompt_images(prompts: list[list[int]], images: list | None, image_token: int | None) -> None:
    """Refuse, before vLLM sees them, image prompts that would be read wrong.

    ``images`` is None or parallel to ``prompts``: per prompt None / [] (text) or its images. A
    prompt with k images must hold exactly k image tokens, ONE per image: vLLM expands each to the
    image's token count itself (vllm 0.32.0 model_executor/models/qwen3_vl.py:1740-1745, a
    PromptReplacement of the single token by ``grid_thw.prod() // merge_size**2`` copies,
    :1672-1678), so an already expanded prompt or a missing placeholder would not match. A prompt
    without images must not hold the image token: vLLM would embed it as a plain word, silently.
    """
    if images is None:
        return
    if len(images) != len(prompts):
        raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts; pass one per prompt "
                         "(None for a text prompt)")
    for i, (ids, imgs) in enumerate(zip(prompts, images)):
        k = len(imgs) if imgs else 0
        if k and image_token is None:
            raise ValueError(f"prompt {i} has {k} images but the model takes none (no image token in its config)")
        if image_token is None:
            continue
        found = sum(1 for t in ids if int(t) == image_token)
        if found != k:
            what = ("one per image (vLLM expands each itself; pass the unexpanded prompt)" if k else
                    "none for a prompt without images")
            raise ValueError(f"prompt {i} holds {found} image tokens (id {image_token}) for {k} images; "
                             f"it needs {what}")


def check_encoder_cache_reset(llm_engine, multimodal: bool) -> None:
    """A multimodal engine must be able to drop its encoder cache after a weight push.

    vLLM keeps the vision encoder's output of an image for later requests, keyed only by the
    image's hash (vllm 0.32.0 v1/core/encoder_cache_manager.py:19-41: unreferenced entries stay
    "freeable" until space is needed; the tensors sit in the runner's ``encoder_cache`` dict,
    v1/worker/gpu_model_runner.py:579, :2784). After new vision weights, the same image would be
    read through embeddings of the old ones. On the CPU reload path it fails loudly instead:
    ``GPUModelRunner.reload_weights`` clears the runner's dict (gpu_model_runner.py:5287-5304)
    but not the scheduler's ``EncoderCacheManager``, which still counts the image as encoded, so
    the next request with it raises "Encoder cache miss" (gpu_model_runner.py:3052-3063; measured
    on the tiny Qwen3-VL, and that engine did not recover). ``LLMEngine.reset_encoder_cache``
    (v1/engine/llm_engine.py:410-416 -> v1/engine/core.py:878-896) resets both; vLLM itself calls
    it on no weight-update path it offers to this rollout (direct ``load_weights`` touches
    neither cache). The NPU pin has the same chain down to vllm-ascend's worker (vllm 0.23.0
    v1/engine/llm_engine.py:344-350; vllm-ascend 0.23.0 worker/worker.py:982-983; see
    docs/accelerators.md).
    """
    if multimodal and not callable(getattr(llm_engine, "reset_encoder_cache", None)):
        raise RuntimeError(f"{type(llm_engine).__name__} has no reset_encoder_cache: after a weight update this vLLM "
                           "would reuse vision embeddings of the old weights; install the vLLM of requirements-*.txt")


def registry_subprocess_command(command: list[str], package_root: str) -> list[str] | None:
    """vLLM's model-registry inspection command made to install rlcore's torchvision shim first;
    None when ``command`` is not the ``[python, "-m", module]`` form it knows.

    On a model whose class vLLM has not inspected before (no entry under
    ``$VLLM_CACHE_ROOT/modelinfos``), vLLM builds its config by running ``python -m
    vllm.model_executor.models.registry`` in a subprocess (vllm 0.32.0
    model_executor/models/registry.py:797 _SUBPROCESS_COMMAND, :1077-1080 inspect_model_cls ->
    _run_in_subprocess, :1562-1564). That fresh interpreter imports ``vllm.config`` ->
    transformers' image utilities -> torchvision, which fails on a CPU host with the public
    torchvision wheel unless rlcore's shim ran first (rlcore/torchvision_shim.py): "Model
    architectures [...] failed to be inspected". It hits any cold cache, text models too; Qwen3-VL
    is simply the first class this project's machines had not inspected yet.
    """
    if len(command) != 3 or command[1] != "-m":
        return None
    python, _, module = command
    code = (f"import sys; sys.path.insert(0, {package_root!r}); import rlcore, runpy; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [python, "-c", code]


@contextmanager
def registry_subprocess_with_shim(registry, needed: bool, package_root: str):
    """While the engine builds, run vLLM's registry subprocess through registry_subprocess_command
    (``registry``: the module ``vllm.model_executor.models.registry``, or None). Only when
    ``needed`` (the shim was installed in this process); restored after."""
    original = getattr(registry, "_SUBPROCESS_COMMAND", None) if needed and registry is not None else None
    patched = registry_subprocess_command(list(original), package_root) if original is not None else None
    if patched is None:
        if original is not None:
            log.warning("vLLM's registry subprocess command %r has an unknown form; a cold model-info cache may "
                        "fail to import torchvision there", original)
        yield
        return
    registry._SUBPROCESS_COMMAND = patched
    try:
        yield
    finally:
        registry._SUBPROCESS_COMMAND = original


def check_engine_kwargs(field_names: Iterable[str], kwargs: dict) -> None:
    """Refuse, before the build, ``LLM(...)`` keywords this vLLM's ``EngineArgs`` lacks (``LLM``
    passes them on: vllm 0.23.0 entrypoints/llm.py:176, engine/arg_utils.py). All of them exist in
    0.23.0 and 0.32.0; a vLLM without ``logprobs_mode`` would return logprobs of the unscaled
    logits, which the trainer must not get silently."""
    missing = sorted(set(kwargs) - set(field_names))
    if missing:
        hint = (" (without logprobs_mode vLLM returns log_softmax of the raw logits, not of logits / T)"
                if "logprobs_mode" in missing else "")
        raise ValueError(f"this vLLM's EngineArgs lacks {missing}{hint}; install the vLLM of "
                         "requirements-*.txt (>= 0.23.0)")


def align_sampler_logprobs_mode(model_runner, mode: str) -> bool:
    """Make the runner's sampler use ``mode``; True when it had another one.

    vllm-ascend 0.23.0 (and 0.26.0rc1) builds ``AscendSampler()`` without the engine's
    ``logprobs_mode`` (vllm_ascend/worker/model_runner_v1.py:333; default "raw_logprobs",
    sample/sampler.py:15,73), so ``logprobs_mode="processed_logprobs"`` is silently ignored on NPU
    and the logprobs would be of the unscaled logits. The mode is only read at sampling time, from
    the sampler (vllm 0.23.0 v1/sample/sampler.py:79,255) and its top-k/top-p sampler (vllm-ascend
    0.23.0 sample/sampler.py:164-179; on NPU ``forward`` is ``forward_native`` whatever the mode,
    vllm 0.23.0 v1/sample/ops/topk_topp_sampler.py:86-129), so setting both after the build is
    enough. A sampler already in the mode is left alone (vLLM's V2 runner: its sampler takes the engine's
    mode, v1/worker/gpu/sample/sampler.py:57), as is a runner without a sampler."""
    sampler = getattr(model_runner, "sampler", None)
    current = getattr(sampler, "logprobs_mode", None)
    if current is None or current == mode:
        return False
    topk = getattr(sampler, "topk_topp_sampler", None)
    if topk is not None and not hasattr(topk, "logprobs_mode"):
        raise RuntimeError(f"{type(sampler).__name__} uses logprobs_mode={current!r}, and its top-k/top-p "
                           f"sampler cannot be switched to {mode!r}")
    log.warning("%s was built with logprobs_mode=%r (vllm-ascend ignores the engine setting); set to %r",
                type(sampler).__name__, current, mode)
    sampler.logprobs_mode = mode
    if topk is not None:
        topk.logprobs_mode = mode
    return True


def runner_reload_weights(worker, **kwargs):
    """``collective_rpc`` callable (called with the worker: vllm 0.23.0 v1/serial_utils.py:486-510)
    for workers without ``reload_weights``: what vllm-ascend 0.26.0rc1's NPUWorker.reload_weights
    does (worker/worker.py:1115-1116). vllm-ascend 0.23.0's NPUModelRunner inherits vLLM's
    GPUModelRunner.reload_weights (vllm 0.23.0 v1/worker/gpu_model_runner.py:5320). Under the
    worker's vLLM config, as vLLM's own ``Worker.reload_weights`` calls it (vllm 0.32.0
    v1/worker/gpu_worker.py:629-631): the weight loaders and the post-load steps read the current
    config (e.g. to build quantization or MoE kernels) and fail or fall back without it."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        return worker.model_runner.reload_weights(**kwargs)


def reset_prefix_cache(llm, attempts: int = 3) -> None:
    """Drop vLLM's cached prefix blocks after a weight change, or raise. ``LLM.reset_prefix_cache``
    returns False and keeps the cache while any block is still held (vllm 0.32.0
    v1/core/block_pool.py:827-844; entrypoints/llm.py:829-834): the next prompts would then reuse KV
    computed with the old weights. Between generate calls nothing should hold a block; retried
    (``attempts`` times, a short wait for an engine step to finish) before failing loudly."""
    import time

    for attempt in range(attempts):
        if llm.reset_prefix_cache() is not False:  # None: a vLLM whose method returns nothing
            return
        time.sleep(0.05 * (attempt + 1))
    raise RuntimeError(f"vLLM refused to reset its prefix cache {attempts} times (blocks still held by unfinished "
                       f"requests): its cached KV was computed with the old weights. Make sure no request is in "
                       f"flight during a weight update")


def reload_weights_method(worker):
    """What ``collective_rpc`` calls to reload: "reload_weights" where the worker has it (vLLM's
    Worker, CPUWorker, vllm-ascend >= 0.26.0rc1), else ``runner_reload_weights`` when the model
    runner has it (vllm-ascend 0.23.0), else None."""
    if hasattr(worker, "reload_weights"):
        return "reload_weights"
    if hasattr(getattr(worker, "model_runner", None), "reload_weights"):
        return runner_reload_weights
    return None


def check_sleep_level_supported(llm_cls, device_type: str, sleep_level: int) -> None:
    """Level 0 frees only the KV cache through ``LLM.release_kv_cache_memory``, which vllm 0.32.0
    has (vllm/entrypoints/llm.py:861) and vllm 0.26.0 / 0.23.0 do not (0.23.0 LLM has sleep and
    wake_up only, entrypoints/llm.py:807,832)."""
    if device_type != "cpu" and sleep_level == 0 and not hasattr(llm_cls, "release_kv_cache_memory"):
        raise ValueError("sleep_level=0 (free only the KV cache) needs LLM.release_kv_cache_memory (vllm >= 0.32); "
                         "this vLLM lacks it: use sleep_level 1 or 2")


def drain_paused_engine(llm, max_steps: int = 8) -> int:
    """Step a paused in-process engine until it is idle, as ``release_kv_cache_memory`` requires: a
    paused scheduler with no requests and an empty batch queue (vllm 0.32.0 v1/engine/core.py:1021-1033).
    Returns the steps taken.

    ``LLM.generate`` stops stepping once its outputs are finished (entrypoints/common/offline.py:610),
    which leaves the engine core (InprocClient: nothing steps it between calls, v1/engine/core_client.py:385-388)
    holding (a) the finished requests' ids until the next ``schedule()`` (v1/core/sched/scheduler.py:2736,
    cleared at :1647), so ``scheduler.has_requests()`` is True (:2813-2815, :2823-2838), with or without
    async scheduling; and (b) with async scheduling, which vLLM turns on for the external launcher on CUDA
    (config/vllm.py:1585-1644; queue of 2, :577-587), the batch scheduled ahead of the outputs
    (core.py:698-768). A multiprocess engine's busy loop steps until both are gone (``has_work``,
    core.py:1534-1540); this does the same: an empty step sends the finished ids to the runner (1 step),
    and with a batch in flight one more step collects it (2 in all; the next decode was launched already).
    The sampled outputs, of requests already returned, are dropped."""
    client = llm.llm_engine.engine_core  # InprocClient (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    core = client.engine_core
    steps = 0
    while core.scheduler.has_requests() or core.batch_queue:
        if steps == max_steps:
            raise RuntimeError(f"rollout.sleep_level=0: the paused vLLM engine still holds requests or queued "
                               f"batches after {max_steps} steps (batch queue {len(core.batch_queue or ())}), and "
                               f"release_kv_cache_memory needs it idle; make sure no request is in flight at "
                               f"release_memory(), or set rollout.sleep_level to 1 or 2")
        client.get_output()
        steps += 1
    return steps


# What a fused-MoE layer is in each pinned vLLM: vllm 0.32.0 builds ``MoERunner`` layers
# (model_executor/layers/fused_moe/runner/moe_runner.py:228, a MoERunnerInterface,
# runner/moe_runner_interface.py:19) through ``FusedMoEFactory`` (fused_moe/layer.py:88) and has no
# class FusedMoE; vllm 0.23.0 and vllm-ascend 0.23.0 (AscendFusedMoE) subclass ``FusedMoE``.
FUSED_MOE_CLASSES = ("FusedMoE", "MoERunnerInterface")


def has_fused_moe(model) -> bool:
    """Whether ``model`` (vLLM's) holds a fused mixture-of-experts layer."""
    return any(c.__name__ in FUSED_MOE_CLASSES for m in model.modules() for c in type(m).__mro__)


def kv_zeroing_needed(llm) -> bool:
    """Whether the engine zeroes new KV blocks through precomputed addresses: its scheduler's
    ``needs_kv_cache_zeroing`` (vllm 0.32.0 v1/core/sched/scheduler.py:376, from
    KVCacheConfig.needs_kv_cache_zeroing; the worker builds the zeroer, v1/worker/gpu_worker.py:902).
    False where the engine has no such flag (older vLLM)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    return bool(getattr(getattr(core, "scheduler", None), "needs_kv_cache_zeroing", False))


def check_weight_load(choice: str, device_type: str, worker, model) -> None:
    """Refuse a load path the built engine cannot do, before the first push."""
    if choice == "reload" and reload_weights_method(worker) is None:
        raise RuntimeError(f"weight_load=reload: {type(worker).__name__} and its model runner have no "
                           "reload_weights; use weight_load=direct")
    if choice == "direct" and has_fused_moe(model):
        # vllm-ascend transposes the experts' weights after loading (0.23.0
        # vllm_ascend/ops/fused_moe/fused_moe.py:112-119; 0.26.0rc1 :132-139), vllm 0.32.0's FlashInfer
        # backends shuffle / swap them (fused_moe/oracle/unquantized.py); load_weights would write
        # checkpoint layout into them. reload_weights re-runs that processing. (pick_weight_load
        # refuses it from the config already; this guards a directly built engine.)
        raise RuntimeError(f"weight_load=direct cannot load MoE experts on {device_type} (vLLM re-lays them out "
                           "after loading); use weight_load=reload")


# ----------------------------------------------------------------------------- seeds


def request_seed(seed: int | str, dp_rank: int, prompt_idx: int) -> int:
    """Stable 56-bit seed per (call seed, DP replica, prompt); the same on every TP rank.

    vLLM gives the n children of a request ``seed + i``; 56 bits leave room for that inside
    int64 and make collisions between prompts/replicas practically impossible.
    """
    digest = hashlib.blake2b(f"{seed}/{dp_rank}/{prompt_idx}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def unseeded_call_seed(engine_seed: int, call_index: int) -> str:
    """Call seed for the ``call_index``-th ``generate(seed=None)`` of an engine.

    Every request is sent seeded: vllm 0.32.0's V2 model runner (the CUDA default when Triton
    is present, vllm/config/vllm.py:702-739) draws the seed of an unseeded request from numpy's
    GLOBAL RNG (vllm/v1/worker/gpu/sample/states.py:54-57), which holds the trainer's per-rank
    state, so the ranks of one TP group would sample different tokens. Derived from the engine
    seed and a call counter, the seed is equal on TP ranks (they make the same calls) and
    reproducible from a fresh engine; request_seed() adds the DP rank.
    """
    return f"unseeded/{engine_seed}/{call_index}"


# ----------------------------------------------------------------------------- weight checks


@contextmanager
def capture_load_weights(model):
    """Record what ``model.load_weights`` returns while vLLM calls it (reload_weights calls it on
    this very object: vllm 0.32.0 model_loader/reload/inplace.py:95, vllm 0.23.0
    v1/worker/gpu_model_runner.py:5345,5369). Yields a list: one entry per call (None if the model
    does not report). The instance attribute shadows the class method and is removed after."""
    calls: list = []
    original = model.load_weights
    had_own = "load_weights" in vars(model)

    def spy(weights: Iterable):
        loaded = original(weights)
        calls.append(None if loaded is None else set(loaded))
        return loaded

    model.load_weights = spy
    try:
        yield calls
    finally:
        if had_own:
            model.load_weights = original
        else:
            del model.load_weights


def missing_params(model, loaded: Iterable[str]) -> list[str]:
    """vLLM parameter names the load did not write. Both sides use vLLM's own names (fused
    qkv_proj / gate_up_proj), as vLLM's loader compares them (vllm 0.32.0
    model_loader/default_loader.py:526, :562). Tied parameters appear once in named_parameters."""
    return sorted({name for name, _ in model.named_parameters()} - set(loaded))


def loader_name(model) -> str:
    """The engine's weight loader, as an error message names it: the model class's ``load_weights``
    and the vLLM release it comes from."""
    import sys

    version = getattr(sys.modules.get("vllm"), "__version__", "?")
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}.load_weights (vllm {version})"


def require_all_loaded(model, calls: list, what: str, refill: bool = True) -> None:
    """Raise naming the parameters a full push did not write: after a level-2 sleep (``refill``) they
    hold garbage; at the first full push after a build they keep the checkpoint's weights, which vLLM
    would sample from for the whole run. A tensor sent under a name the engine's loader does not
    accept is dropped without an error (vllm 0.23.0 models/qwen3_moe.py:651-652; nothing checks
    afterwards, models/utils.py:271-283), so the message names the loader. No check when the model
    does not report its loaded names.
    Limit: vLLM adds a fused parameter (qkv_proj, gate_up_proj) to the set once ANY shard arrived,
    so a missing q/k/v or gate/up shard is caught by ColocateRollout._check_full (HF names against
    the previous full push), not here."""
    if not calls or any(c is None for c in calls):
        log.warning("%s: the model's load_weights does not report loaded names; completeness unchecked", what)
        return
    missing = missing_params(model, set().union(*calls))
    if missing:
        state = ("hold garbage (the level-2 sleep discarded their memory)" if refill else
                 "still hold the checkpoint's weights, which vLLM would sample from for the whole run")
        raise RuntimeError(f"{what} left {len(missing)} vLLM parameters unwritten, which {state}: "
                           f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. {loader_name(model)} did not load "
                           f"what was sent for them: the names it accepts differ from those sent (it drops unknown "
                           f"names without an error), or the push left them out")


# ----------------------------------------------------------------------------- teardown / log


def detach_client_finalizer(client) -> None:
    """vllm 0.32.0's InprocClient finalizer runs EngineCore.shutdown, which destroys the default
    process group (v1/engine/core_client.py:383; core.py shutdown -> cleanup_dist_env_and_memory).
    The InprocClient of vllm 0.23.0 (v1/engine/core_client.py:285-306) and 0.26.0 (:280-306) has
    no finalizer."""
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def describe_engine(vllm_config, *, device_type: str, tp_size: int, dp_size: int, weight_load: str,
                    sleep_level: int, emulate_sleep: bool = False) -> str:
    """One line: the settings the built engine actually uses (read back from its config)."""
    mc, cc, sc = vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config
    dtype = str(getattr(mc, "dtype", "?")).replace("torch.", "")
    release = ("KV buffer freed (CPU: no sleep mode)" if device_type == "cpu" and not emulate_sleep
               else f"sleep level {sleep_level}{' (emulated on CPU)' if emulate_sleep else ''}")
    graphs = "eager" if mc.enforce_eager else "graphs"
    mm = getattr(mc, "multimodal_config", None)  # None for a text model (vllm 0.32.0 config/model.py:1980-1982)
    mm_part = "" if mm is None else (f" images/prompt<={mm.get_limit_per_prompt('image')} "
                                     f"videos/prompt<={mm.get_limit_per_prompt('video')} "
                                     f"mm_processor_cache_gb={mm.mm_processor_cache_gb:g}")
    return (f"vLLM on {device_type}: tp={tp_size} dp={dp_size} dtype={dtype} enforce_eager={mc.enforce_eager} "
            f"({graphs}) weight_load={weight_load} release={release} "
            f"prefix_caching={getattr(cc, 'enable_prefix_caching', None)} block_size={getattr(cc, 'block_size', None)} "
            f"max_num_seqs={getattr(sc, 'max_num_seqs', None)} "
            f"max_num_batched_tokens={getattr(sc, 'max_num_batched_tokens', None)}{mm_part}")


def greedy_threshold() -> float:
    """The temperature below which vLLM samples greedily and refuses ``n > 1``: its own constant
    (vllm 0.32.0 and 0.23.0 sampling_params.py ``_SAMPLING_EPS``), 1e-5 where it cannot be read."""
    try:
        from vllm.sampling_params import _SAMPLING_EPS
    except ImportError:
        return 1e-5
    return float(_SAMPLING_EPS)


def prompt_input(ids: list[int], images: list | None):
    """One request for vLLM: the token ids, plus the images when there are any (vLLM takes PIL
    images under ``multi_modal_data["image"]`` and expands the image tokens itself)."""
    from vllm.inputs import TokensPrompt

    ids = [int(t) for t in ids]
    if not images:
        return TokensPrompt(prompt_token_ids=ids)
    return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": list(images)})


def detached(weights: Iterable[tuple[str, torch.Tensor]], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, detached, lazily (one tensor alive at a time beyond what the caller holds),
    their names appended to ``names``."""
    for name, tensor in weights:
        names.append(name)
        yield name, tensor.detach()
