"""Pure decisions and checks behind ``rlcore.rollout.engine`` (no vLLM import here).

Each helper takes plain values or the vLLM objects as arguments, so the logic is unit-tested
with small fakes (tests/test_rollout_accel.py) while the code paths that only run on
accelerators stay checked against the pinned packages' sources, cited by file:line:
  vllm 0.32.0 (CUDA wheel), vllm 0.23.0 + vllm-ascend 0.23.0 (requirements-npu.txt pin),
  vllm 0.26.0 + vllm-ascend 0.26.0rc1 (an earlier candidate). docs/accelerators.md has the table.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, MutableMapping
from contextlib import contextmanager

log = logging.getLogger("rlcore.rollout")

# vllm-ascend: 0 = no FRACTAL_NZ weight format (1, the default, = quantized weights only; 2 = all).
NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"


# ----------------------------------------------------------------------------- engine settings


def pick_sleep_level(device_type: str, sleep_level: int | None, emulate: bool = False) -> int:
    """vLLM sleep level used by release_memory on accelerators (0: free the KV cache only,
    1: also move the weights to host memory, 2: also discard the weights); 0 on CPU unless
    ``emulate`` (rollout.emulate_sleep: the CPU engine sleeps as a device's does, rlcore.rollout.cpu_sleep).

    None picks 2: the phase switch pushes every weight before each generation anyway, so the
    host copy that level 1 keeps (and copies back at wake-up) would be wasted work and memory.
    """
    if sleep_level is not None and sleep_level not in (0, 1, 2):
        raise ValueError(f"sleep_level must be 0 (KV cache only), 1 or 2 (or None = auto), got {sleep_level}")
    if emulate and device_type != "cpu":
        raise ValueError(f"emulate_sleep is for CPU engines; on {device_type} vLLM's sleep mode is real")
    if device_type == "cpu" and not emulate:
        return 0  # sleep mode is rejected on CPU and llm.sleep() there makes generate() hang
    return 2 if sleep_level is None else sleep_level


def pick_weight_load(device_type: str, weight_load: str, moe: bool = False) -> str:
    """How update_weights loads: "reload" (vLLM's reload_weights: layer-wise restore, load,
    post-process, copy back) or "direct" (``model.load_weights`` straight into vLLM's parameters).

    auto: reload on CPU, where fp32 linear weights are repacked into oneDNN handles after loading
    (vllm 0.32.0 vllm/model_executor/layers/linear.py:206 UnquantizedLinearMethod
    .process_weights_after_loading -> dispatch_cpu_unquantized_gemm). direct on CUDA and NPU:
    unquantized dense layers need no post-load processing there once vllm-ascend's FRACTAL_NZ cast
    is off (vllm-ascend 0.23.0 vllm_ascend/ops/linear.py:86-98, maybe_trans_nz is a no-op with
    weight_nz_mode=0, utils.py:261-298), and vllm-ascend 0.23.0's NPUWorker has no reload_weights
    (vllm_ascend/worker/worker.py:89-1037; 0.26.0rc1 adds it at worker.py:1115): reload goes through
    its model runner there (see reload_weights_method). A mixture-of-experts model (``moe``)
    reloads on every device: vLLM's fused-MoE layers post-process (CPU: pre-pack, see
    cpu_repack.cpu_repack_on_reload) the expert weights after loading, and Ascend refuses a direct MoE load.
    """
    if weight_load not in ("auto", "reload", "direct"):
        raise ValueError(f"weight_load must be auto, reload or direct, got {weight_load!r}")
    if weight_load == "direct" and device_type == "cpu":
        raise ValueError("weight_load=direct does not work on CPU (vLLM repacks linear weights); use reload")
    if weight_load == "direct" and moe:
        # vllm 0.32.0 fused_moe/oracle/unquantized.py: the FlashInfer TRTLLM / CUTLASS backends
        # shuffle the expert tensors and swap w13 into w31 after loading, so a direct load writes
        # checkpoint-layout tensors into kernel-layout storage (same shapes, wrong experts); the CPU
        # kernel pre-packs them (cpu_repack.py). No backend is known to need no post-load step.
        raise ValueError("weight_load=direct is not supported for mixture-of-experts models: vLLM post-processes "
                         "the expert weights after loading (layout shuffles, w13/w31 swaps, pre-packing), which a "
                         "direct load skips; use reload (or auto)")
    if weight_load == "auto":
        return "reload" if device_type == "cpu" or moe else "direct"
    return weight_load


# The first vllm-ascend whose NPUWorker.wake_up no longer swaps the expert tensors (0.26.0rc1
# worker/worker.py:247-270) and that has NPUWorker.reload_weights (:1115-1116).
NPU_MOE_NEEDS = "vllm-ascend 0.26.0rc1 or newer (with its vLLM)"


def check_npu_moe(device_type: str, experts: int) -> None:
    """Refuse a mixture-of-experts model on Ascend with the pinned vllm-ascend 0.23.0, whose
    ``NPUWorker.wake_up`` replaces each layer's ``w13_weight`` / ``w2_weight`` by transposed views
    (vllm_ascend/worker/worker.py:251-269): the in-place reload then re-runs the fused-MoE post-load
    step on them and copies [E, H, 2I] data into [E, 2I, H] storage, and a direct load skips that
    step (refused for MoE everywhere, see pick_weight_load): the first weight sync breaks the
    experts either way. vllm-ascend 0.26.0rc1 dropped the swap; its vLLM is not installable with
    this project's pins (requirements-npu.txt)."""
    if device_type == "npu" and experts > 0:
        raise ValueError(f"a mixture-of-experts model ({experts} experts) cannot be trained on Ascend NPUs with the "
                         f"pinned vllm-ascend 0.23.0: its wake_up swaps the expert tensors for transposed views, so "
                         f"the first weight sync would corrupt the experts. It needs {NPU_MOE_NEEDS}; train MoE "
                         f"models on CUDA GPUs, or a dense model on NPUs")


def pick_enforce_eager(device_type: str, enforce_eager: bool | None) -> bool:
    """None: eager on CPU (no CUDA graphs there; it also skips the inductor compile of the
    sampler helpers, 10-15 s per process), graphs on CUDA and NPU.

    Graphs survive sleep/wake because weights and KV cache come back at the same device
    addresses: the handle kept per allocation holds its virtual address and wake-up maps new
    physical memory there (vllm 0.32.0 vllm/device_allocator/__init__.py:13-14 HandleType,
    cumem.py:277-278 unmap in sleep, :346-350 create_and_map in wake_up; vllm-ascend 0.26.0rc1
    vllm_ascend/device_allocator/camem.py:74-75, :217, :240). The graph pool itself is outside
    the weights/kv_cache pools and stays resident (vllm 0.32.0 sleep_mode_backend.py:131-136,
    model.py:380 sleep_mode_offload_cudagraph=False). Weight pushes write into the existing
    parameter storage (direct: weight_loader copy_; reload: vllm 0.32.0
    model_loader/reload/layerwise.py:417 _copy_and_restore_kernel_tensors), so captured
    pointers stay valid.
    """
    return device_type == "cpu" if enforce_eager is None else bool(enforce_eager)


CPU_BLOCK_SIZE = 32


def pick_block_size(device_type: str, block_size: int | None, enable_prefix_caching: bool | None = None) -> int | None:
    """Tokens per KV-cache block; None leaves vLLM's default.

    On CPU the default is 32, not vLLM's 128 (vllm 0.32.0 platforms/cpu.py:292-293): prefix caching
    shares only full blocks, so with 128-token blocks no prompt shorter than 128 tokens is shared
    and each of a prompt's n samples recomputes it. The CPU attention kernels take any multiple of
    32 (v1/attention/backends/cpu_attn.py:65-66). Measured on SmolLM2-135M, 16 word problems of
    50-66 tokens x 8 samples x 24 tokens, 2 cores: 13.7 s a generate with 128-token blocks, 7.5 s
    with 32 (12.7 s with 32 and prefix caching off). Accelerators keep vLLM's default."""
    if block_size is not None:
        if block_size < 1 or (device_type == "cpu" and block_size % CPU_BLOCK_SIZE):
            raise ValueError(f"block_size={block_size}: vLLM's CPU attention needs a multiple of {CPU_BLOCK_SIZE} "
                             f"(v1/attention/backends/cpu_attn.py:65), e.g. 32, or null for {CPU_BLOCK_SIZE}"
                             if device_type == "cpu" else f"block_size={block_size} must be > 0, or null")
        return block_size
    return CPU_BLOCK_SIZE if device_type == "cpu" and enable_prefix_caching is not False else None


def speed_kwargs(*, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool | None = None, block_size: int | None = None) -> dict:
    """The scheduler/cache settings that were set (None = leave vLLM's own default in place)."""
    given = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                 enable_prefix_caching=enable_prefix_caching, block_size=block_size)
    return {k: v for k, v in given.items() if v is not None}


def is_multimodal_config(config: dict) -> bool:
    """Whether an HF ``config.json`` (as a dict) describes a model that takes images (or audio):
    Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) and the other vision-language configs of transformers nest
    a ``vision_config``; audio-language ones an ``audio_config``. Read before the engine exists, to
    pick the multimodal engine settings (multimodal_kwargs); the built engine's own answer is
    ``ModelConfig.is_multimodal_model`` (vllm 0.32.0 config/model.py:1980-1982)."""
    return isinstance(config.get("vision_config"), dict) or isinstance(config.get("audio_config"), dict)


def multimodal_kwargs(multimodal: bool, *, limit_mm_per_prompt: dict[str, int] | None = None,
                      mm_processor_cache_gb: float | None = None) -> dict:
    """The ``LLM(...)`` keywords for images in prompts; {} for a text model unless asked for.

    ``limit_mm_per_prompt`` ({"image": 2, "video": 0}): set only when given (vLLM's default is
    999 items of each modality, vllm 0.32.0 config/multimodal.py:307-325). vLLM refuses a prompt
    with more items, and on accelerators sizes the encoder's profiling run by it; a 0 keeps that
    modality out (no dummy videos profiled).

    ``mm_processor_cache_gb``: None gives 0 on a multimodal model. vLLM's default, 4 GiB
    (config/multimodal.py:357), is an LRU of the processed items, pixel tensors included, in host
    memory: with the in-process engine (one API process, vLLM DP 1) the cache type is "lru"
    (multimodal/cache/factories.py:23-46), whose engine-side half keeps every new item's
    ``MultiModalKwargsItem`` until 4 GiB are full (multimodal/cache/lru.py:86-122, sized at
    :99-107). A GRPO step brings new images every time (the n samples of a prompt are one request,
    processed once), so the cache would only grow to its cap on every rank, beside the trainer,
    and hit again at best once an epoch. With 0 nothing is cached (factories.py:31-33) and each image is processed
    in its request (multimodal/processing/processor.py:1511-1512 -> _apply_hf_processor), which
    still hashes it (processor.py:1480-1482): the prefix cache and the encoder cache keep telling
    images apart.
    """
    kwargs: dict = {}
    if limit_mm_per_prompt is not None:
        bad = {k: v for k, v in limit_mm_per_prompt.items()
               if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0}
        if bad:
            raise ValueError(f"limit_mm_per_prompt must map a modality name to a count >= 0, got {bad}")
        kwargs["limit_mm_per_prompt"] = dict(limit_mm_per_prompt)
    if mm_processor_cache_gb is not None:
        if mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {mm_processor_cache_gb}")
        kwargs["mm_processor_cache_gb"] = float(mm_processor_cache_gb)
    elif multimodal:
        kwargs["mm_processor_cache_gb"] = 0.0
    return kwargs


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


def cpu_prefill_kwargs(device_type: str) -> dict:
    """On CPU, prefills are never chunked: ``{"enable_chunked_prefill": False}``.

    A prompt scheduled in part has its sampled token discarded, and for a seeded request vLLM then
    rewinds the request's generator: ``gen.set_offset(gen.get_offset() - 4)`` (vllm 0.32.0
    v1/worker/gpu_model_runner.py:3495-3502, the mask set at :2056-2060). A CPU
    ``torch.Generator`` has no offset ("CPU Generator does not use offset"), so the step dies as
    soon as a step's prompts exceed ``max_num_batched_tokens`` (every request here is seeded). Without
    chunking the scheduler waits for room instead of splitting a prompt (v1/core/sched/
    scheduler.py:1158-1167). Accelerators keep vLLM's default (their generators have offsets)."""
    return {"enable_chunked_prefill": False} if device_type == "cpu" else {}


def disable_npu_nz(device_type: str, environ: MutableMapping[str, str] | None = None) -> dict:
    """On NPU turn vllm-ascend's FRACTAL_NZ weight format off before the engine builds; returns
    the extra ``LLM(...)`` kwargs that say the same. Other devices: nothing is touched.

    ``NPUWorker.wake_up`` raises ValueError while ``weight_nz_mode`` is non-zero, and the default
    is 1 (vllm-ascend 0.23.0 vllm_ascend/worker/worker.py:241-247, envs.py:92,
    ascend_config.py:247-254; 0.26.0rc1 worker.py:247-253, envs.py:88). NZ also re-lays out
    weights after loading, which in-place pushes would not repeat.
    The config key wins over the env var (0.23.0 ascend_config.py:354-365), so both are set. The env
    var is NOT restored: vllm-ascend reads it lazily on every access (0.23.0 envs.py:118 __getattr__),
    e.g. worker.py:295-301 _check_nz_disabled, so it must stay 0 while the engine lives.
    """
    if device_type != "npu":
        return {}
    environ = os.environ if environ is None else environ
    previous = environ.get(NZ_ENV)
    if previous not in (None, "0"):
        log.warning("%s=%s overridden to 0: vllm-ascend's NPUWorker.wake_up refuses NZ weights", NZ_ENV, previous)
    environ[NZ_ENV] = "0"
    return {"additional_config": {"weight_nz_mode": 0}}


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


def require_all_loaded(model, calls: list, what: str) -> None:
    """Raise naming the parameters a push after a level-2 sleep did not write (their memory was
    discarded, so they hold garbage). No check when the model does not report its loaded names.
    Limit: vLLM adds a fused parameter (qkv_proj, gate_up_proj) to the set once ANY shard arrived,
    so a missing q/k/v or gate/up shard is caught by ColocateRollout._check_full (HF names against
    the previous full push), not here."""
    if not calls or any(c is None for c in calls):
        log.warning("%s: the model's load_weights does not report loaded names; level-2 completeness unchecked", what)
        return
    missing = missing_params(model, set().union(*calls))
    if missing:
        raise RuntimeError(f"{what} after a level-2 sleep left {len(missing)} vLLM parameters unwritten (garbage "
                           f"memory): {missing[:8]}{' ...' if len(missing) > 8 else ''}; push every weight")


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
