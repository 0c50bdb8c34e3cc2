"""Memory plan before launch: bytes per rank of every resident thing, per phase of the switch.

Pure arithmetic from the model's ``config.json`` and the run's ``Config``: no torch.distributed,
no weights (torch only in ``device_total_gb``). GB = 2**30 bytes, as torch reports device memory.
Notation: P parameters, W the ranks FSDP shards over (the world size; parallel.fsdp_size under
HSDP), c bytes of ``model.dtype`` (compute and rollout dtype; master weights are fp32, optimizer
state as OPTIMIZER_BYTES says), T tokens of one micro-batch, h hidden size, V vocab. Each
component's formula is in its function's docstring; docs/memory_plan.md has them all with a
worked Qwen3-8B plan. Vision-language models (Qwen3-VL, Qwen2.5-VL, Qwen2-VL) add their vision
tower (``VisionShape``) to P, the ViT's activations for the images of a micro-batch, and vLLM's
profile run of the ViT.

This module holds the plan: the bytes of each component per phase,
the search for a setting that fits (``suggest_fixes``), ``plan_from_config`` and ``format_plan``.
The model's shape (``ModelShape``, ``VisionShape``: config.json, the processor's image budget,
parameter and activation counts) is in rlcore/plan/model_shape.py; the plan's inputs
(``PlanInputs``) in rlcore/plan/inputs.py.

Phases, in the order a run meets them (the steps are rlcore/step/switch.py's); each total is a peak:
    train     params, gradients, optimizer, activations, FSDP's gathered weights, the resident
              reference, and what vLLM keeps at its sleep level
    checkpoint  the save after the optimizer step, still in the train phase (vLLM asleep), and the
              load on resume (vLLM released first): params and optimizer state on the device, the
              load's extra copy of the state (optimizer_load: torch casts a bf16 state to fp32 before
              it is cast back, OPTIMIZER_LOAD_BYTES), the reference, what vLLM keeps at its sleep
              level; no gradients (freed by zero_grad) and no activations
    sync      to_generation step 3: optimizer offloaded (if configured), vLLM weights woken, trainer
              params still resident, two sync buckets; the KV cache is woken only after
    generate  vLLM's weights + KV cache + activations, plus the trainer state not offloaded; also
              the first generation: the trainer offloads its state before vLLM is built
              (rlcore/run/build.py), so vLLM sizes its KV cache from what generation really has
    judge     (reward.models only) the judges awake, each its whole vLLM budget (weights, KV cache,
              activations: gpu_memory_utilization x device), the policy's engine asleep as for
              training, the trainer state not offloaded; asleep, a judge keeps its overhead
              (judges are built while the policy's engine sleeps: this phase bounds their start-up too)
    teacher   (distill.teacher only) the same for the distillation teacher, which wakes after the
              judges went back to sleep (rlcore/distill): its whole vLLM budget, the judges asleep
A phase fits when its total <= device - RESERVE_GB (CUDA/CANN context and kernels ~1 GB, the
trainer's NCCL/HCCL communicators ~1 GB, allocator fragmentation ~1 GB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rlcore.plan.inputs import DTYPE_BYTES, PlanInputs
from rlcore.plan.judges import JudgePlan, host_lines, teacher_plan
from rlcore.plan.model_shape import ModelShape
from rlcore.plan.vision import vision_activation_bytes

GB = 2**30
RESERVE_GB = {"cuda": 3.0, "npu": 3.0}  # other devices (cpu): 0
VLLM_OVERHEAD_GB = 0.5  # non-torch memory vLLM keeps: TP communicator, cuBLAS/ACL workspaces
# CUDA/ACL graph pool (rollout.enforce_eager false), kept across sleep/wake. A rough allowance:
# vLLM logs the real figure at start-up ("Graph capturing finished ... took X GiB").
VLLM_GRAPHS_GB = 1.0
LOGITS_CHUNK = 1024  # tokens per lm_head chunk of VeOmni's log-prob kernel (its default)
LOGITS_BUFFERS = 6  # fp32 (chunk, V) buffers alive at the kernel's backward peak
LOGITS_FORWARD_BUFFERS = 2  # fp32 (chunk, V) buffers of a no-gradient forward: the logits, their log-softmax
SAMPLER_BUFFERS = 3  # fp32 (max_num_seqs, V) buffers of vLLM's sampler in its profile run
# Optimizer state in bytes per trainable parameter, as measured after a real step (tests/test_optimizer.py:
# the state tensors' nbytes over the trainable shards' elements, tiny Qwen3 of 302,336 parameters on 2 CPU
# ranks): adamw 8.0007 (fp32 exp_avg, exp_avg_sq), anyprecision_adamw 6.0007 (bf16 exp_avg, exp_avg_sq,
# Kahan compensation), float32 state 12.0007, without Kahan 4.0007 (bf16) / 8.0007 (fp32); the 0.0007 is
# one fp32 step counter per parameter tensor, nothing on a real model. Keys: rlcore.plan.memory.optimizer_key.
OPTIMIZER_BYTES = {"adamw": 8, "anyprecision_adamw": 6, "anyprecision_adamw/float32": 12,
                   "anyprecision_adamw/no_kahan": 4, "anyprecision_adamw/float32/no_kahan": 8}
# Optimizer state alive at a resume's peak, bytes per trainable parameter: torch's load_state_dict casts
# every floating state tensor to its parameter's dtype (fp32 master weights; torch 2.13
# torch/optim/optimizer.py:774-803) while the loaded state it cast from is still held, and
# rlcore.engine.optim's post-hook casts it back only after: bf16 state (b bytes) peaks at b + 2b, fp32
# state is not copied (``.to`` of the same dtype returns the tensor). Measured by tests/test_optimizer.py
# (the state and loaded tensors alive when the load's post-hooks start).
OPTIMIZER_LOAD_BYTES = {"adamw": 8, "anyprecision_adamw": 18, "anyprecision_adamw/float32": 12,
                        "anyprecision_adamw/no_kahan": 12, "anyprecision_adamw/float32/no_kahan": 8}


# ------------------------------------------------------------------------------- components

def optimizer_key(optimizer: str = "adamw", state_dtype: str | None = None, kahan_summation: bool | None = None) -> str:
    """OPTIMIZER_BYTES's key of an optim section's choice (null options: VeOmni's defaults, bf16 and Kahan on)."""
    if optimizer == "adamw":
        return "adamw"
    return optimizer + "/float32" * (state_dtype == "float32") + "/no_kahan" * (kahan_summation is False)


def optimizer_bytes(optimizer: str = "adamw", state_dtype: str | None = None, kahan_summation: bool | None = None
                    ) -> int:
    """The optimizer state's bytes per trainable parameter (OPTIMIZER_BYTES, measured)."""
    return OPTIMIZER_BYTES[optimizer_key(optimizer, state_dtype, kahan_summation)]


def optimizer_load_bytes(optimizer: str = "adamw", state_dtype: str | None = None,
                         kahan_summation: bool | None = None) -> int:
    """The optimizer state's bytes per trainable parameter at a resume's peak (OPTIMIZER_LOAD_BYTES)."""
    return OPTIMIZER_LOAD_BYTES[optimizer_key(optimizer, state_dtype, kahan_summation)]


def activation_bytes(p: PlanInputs) -> int:
    """Training activations of one micro-batch of T tokens (compute dtype c, bytes).

    With gradient checkpointing: each layer's input hidden state (layers x T x h) plus one layer
    recomputed with its gradients (2 x T x max layer_activations). Without: every layer's saved
    activations (T x sum of layer_activations) plus one layer's gradients. Plus the head: the
    final hidden state the log-prob kernel saves and its gradient (2 x T x h), and the kernel's
    chunk of LOGITS_CHUNK tokens: LOGITS_BUFFERS fp32 (chunk, V) buffers (logits, softmax, one-hot,
    dlogits and temporaries); the full (T, V) logits never exist. Ulysses: T / U tokens per rank
    (attended sequence by sequence: no mask), plus with shared prompts the whole row's (T, T) mask
    twice (bool, and 0/-inf in c: rlcore.engine.ulysses)."""
    s, t, c = p.shape, -(-p.micro_tokens // p.ulysses), p.c
    mask = (t * p.ulysses) ** 2 * (1 + c) if p.ulysses > 1 and p.share_prompt else 0
    per_layer = [s.layer_activations(i) for i in range(s.layers)]
    if p.gradient_checkpointing:
        layers = s.layers * t * s.hidden * c + 2 * t * max(per_layer) * c
    else:
        layers = t * sum(per_layer) * c + t * max(per_layer) * c
    head = 2 * t * s.hidden * c + LOGITS_BUFFERS * min(LOGITS_CHUNK, t) * s.vocab * 4
    return layers + head + mask + vision_activation_bytes(p)


def no_grad_activation_bytes(p: PlanInputs) -> int:
    """The old-policy and reference log-prob forwards' transient bytes at their own micro-batch of
    T' tokens (``PlanInputs.log_prob_micro_tokens``: algorithm.log_prob_micro_batch_size/_tokens).
    Nothing is saved for a backward, so only one layer is alive at a time: its input and output
    hidden states (2 x T' x h) and its working set (T' x max layer_activations, an upper bound),
    then the head: the final hidden state (T' x h) and LOGITS_FORWARD_BUFFERS fp32 (chunk, V)
    buffers. Ulysses: T' / U per rank, plus the shared-prompt row's (T', T') mask as in training.
    A vision tower is counted as training counts it at that micro-batch (an upper bound)."""
    s, c = p.shape, p.c
    t = -(-p.log_prob_micro_tokens // p.ulysses)
    mask = (t * p.ulysses) ** 2 * (1 + c) if p.ulysses > 1 and p.share_prompt else 0
    layer = max(s.layer_activations(i) for i in range(s.layers))
    head = t * s.hidden * c + LOGITS_FORWARD_BUFFERS * min(LOGITS_CHUNK, t) * s.vocab * 4
    seqs = max(1, p.log_prob_micro_tokens // p.seq_len)
    vision = vision_activation_bytes(replace(p, micro_batch_size=seqs)) if p.shape.vision is not None else 0
    return 2 * t * s.hidden * c + t * layer * c + head + mask + vision


def fsdp_gathered_bytes(p: PlanInputs, activations: int) -> int:
    """Unsharded weights and gradients FSDP2 holds on top of the shards while training, at the
    higher of two moments of the backward:

    - in the decoder layers: the root's gathered weights (c x root; FSDP2 keeps the root
      unsharded between forward and backward), the lm_head gradient the log-prob kernel made
      first (c x lm_head), two layers gathered (the current one and the prefetched one,
      2c x layer) and one layer's gradient before its reduce-scatter in c and in fp32 ((c+4) x layer);
    - at the end: the root's weights, gradients, and the fp32 reduce-scatter input ((2c+4) x root),
      when the activations are gone: counted as what it needs beyond ``activations``.
    Routed experts count with 1/ep of a layer (expert parallelism gathers over world/ep ranks).
    """
    s, c = p.shape, p.c
    layer = max(sum(s.layer(i, p.ep)) for i in range(s.layers))
    in_layers = c * s.root() + c * s.lm_head() + 2 * c * layer + (c + 4) * layer
    at_end = (2 * c + 4) * s.root()
    return max(in_layers, at_end - activations)


def vllm_weight_bytes(p: PlanInputs) -> int:
    """c x (P / tp); key/value projections hold ceil(kv_heads / tp) heads per rank (vLLM
    replicates them when tp > kv heads); norms are replicated (negligible). A vision tower is
    sharded like the decoder (vLLM's mm_encoder_tp_mode "weights", its default) except its patch
    and position embeddings, which every rank holds whole."""
    s = p.shape
    kv = s.layers * 2 * s.hidden * s.head_dim  # one kv head's k and v projections, all layers
    kv_rank = kv * math.ceil(s.kv_heads / p.tp)
    whole = s.vision.replicated() if s.vision else 0
    return p.c * ((s.params - kv * s.kv_heads - whole) // p.tp + kv_rank + whole)


def vllm_activation_bytes(p: PlanInputs) -> int:
    """vLLM's profiled peak: one layer's temporaries on max_num_batched_tokens tokens (2h residual
    and hidden, q/k/v and attention output, gate_up and the activation: all / tp) in c, plus
    SAMPLER_BUFFERS fp32 (max_num_seqs, V) logits of the sampler's dummy run."""
    s = p.shape
    tokens, seqs = p.vllm_defaults()
    mlp = max((s.experts_per_tok * s.moe_intermediate + s.shared_intermediate) if sp else s.intermediate
              for sp in (s.sparse or (False,)))
    per_token = 2 * s.hidden + (2 * s.q_dim + 2 * s.kv_dim + 3 * mlp) // p.tp
    decoder = tokens * per_token * p.c + SAMPLER_BUFFERS * seqs * s.vocab * 4
    encoder, kept = vllm_encoder_bytes(p)
    return max(decoder, encoder) + kept


def vllm_encoder_bytes(p: PlanInputs) -> tuple[int, int]:
    """(the ViT's temporaries, the encoder outputs kept) of vLLM's profile run for a vision model.
    vLLM 0.32 (v1/worker/gpu_model_runner.py profile_run, multimodal/encoder_budget.py) first runs
    the vision tower on the most images of the largest size that its encoder budget admits:
    budget max(max_num_batched_tokens, k) for k = the processor's largest image in tokens
    (VisionShape.max_image_tokens), so n = max(1, min(budget // k, max_num_seqs x image limit))
    images of k tokens, m^2 k patches each; it keeps their outputs (k x output_width each) in its
    encoder cache through the decoder's dummy run. Temporaries per patch, in c: the patch's pixel
    values, 4v unsharded (hidden state, norm output, position embedding, projection output) and
    (4v + 2I) / tp sharded (qkv, attention output, MLP hidden and activated). (0, 0) without a
    vision tower or with rollout.limit_mm_per_prompt.image 0."""
    vis = p.shape.vision
    if vis is None or p.vllm_images == 0:
        return 0, 0
    tokens, seqs = p.vllm_defaults()
    k = vis.max_image_tokens
    images = max(1, min(max(tokens, k) // k, seqs * (p.vllm_images or 1)))
    patches = images * k * vis.merge ** 2
    per_patch = vis.patch_pixels + 4 * vis.hidden + (4 * vis.hidden + 2 * vis.intermediate) // p.tp
    return patches * per_patch * p.c, images * k * vis.output_width() * p.c


def kv_bytes_per_token(p: PlanInputs) -> int:
    """2 (k and v) x layers x kv heads per TP rank x head_dim x c."""
    s = p.shape
    return 2 * s.layers * math.ceil(s.kv_heads / p.tp) * s.head_dim * p.c


def sync_bucket_bytes(p: PlanInputs) -> int:
    """About two buckets in flight (the gather buffer and the full tensors being loaded); a bucket
    is at least the largest sync unit (the embedding for most models). Mixture of experts: a
    layer's routed experts are gathered whole, one fused parameter at a time (rlcore.engine_veomni
    ``_whole``: FSDP2, then the EP group): the [E, 2I, H] gate_up_proj twice (the all-gather's
    output and the tensor re-laid out from it, DTensor.full_tensor over a dim-1 shard) while the
    [E, H, I] down_proj before it may still be loading, (2 x 2 + 1) E H I c: 1.9 GiB per rank for
    Qwen3-30B-A3B in bf16, where one expert (the largest bucket unit) suggested 1.16."""
    s = p.shape
    buckets = 2 * max(int(p.sync_bucket_mb * 2**20), s.largest_sync_unit() * p.c)
    moe = 5 * s.experts * s.hidden * s.moe_intermediate * p.c if s.experts else 0
    return max(buckets, moe)


def component_bytes(p: PlanInputs) -> dict[str, int]:
    """Bytes per rank of each component while it is resident. The sharded trainer state:
    trainer_params 4P/W (fp32 master), gradients 4P'/W (fp32: FSDP2 reduces in float32; freed by
    zero_grad after each step), optimizer bP'/W (made at the first step; b = OPTIMIZER_BYTES of
    optim.optimizer: 8 for AdamW's fp32 exp_avg + exp_avg_sq, 6 for anyprecision_adamw's bf16
    exp_avg + exp_avg_sq + Kahan buffer), optimizer_load (b_load - b)P'/W (the resume's fp32 copy
    of a bf16 state, OPTIMIZER_LOAD_BYTES), reference cP/W (kl_loss_coef > 0); P counts a vision
    tower, P' = P less a frozen one.
    vllm_overhead: VLLM_OVERHEAD_GB, + VLLM_GRAPHS_GB with CUDA/ACL graphs. kv_cache: what vLLM's
    budget (gpu_memory_utilization x device) leaves after its weights, its profiled activations
    and that overhead (vLLM 0.32 counts its graph estimate against the budget too); negative means
    vLLM cannot start."""
    P, trainable = p.shape.params, p.trainable
    vllm_budget = int(p.gpu_memory_utilization * p.device_gb * GB)
    sizes = {
        "trainer_params": 4 * P // p.shard, "gradients": 4 * trainable // p.shard,
        "optimizer": p.optimizer_bytes * trainable // p.shard,
        "optimizer_load": (p.optimizer_load_bytes - p.optimizer_bytes) * trainable // p.shard,
        "reference": p.c * P // p.shard if p.reference and not p.lora_rank else 0,  # LoRA: the adapter off
        "activations": activation_bytes(p), "vllm_weights": vllm_weight_bytes(p),
        "vllm_activations": vllm_activation_bytes(p),
        "vllm_overhead": int((VLLM_OVERHEAD_GB + VLLM_GRAPHS_GB * p.graphs) * GB),
        "sync_buckets": sync_bucket_bytes(p),
    }
    sizes["fsdp_gathered"] = fsdp_gathered_bytes(p, sizes["activations"])
    # the no-gradient forwards run in the train phase before the update, never beside its activations
    sizes["activations"] = max(sizes["activations"], no_grad_activation_bytes(p))
    sizes["judges"] = sum(int(j.gpu_memory_utilization * p.device_gb * GB) for j in p.judges)  # all awake at once
    sizes["judges_asleep"] = len(p.judges) * int(VLLM_OVERHEAD_GB * GB)  # eager: no graph pool
    if p.teacher:
        sizes["teacher"] = int(p.teacher.gpu_memory_utilization * p.device_gb * GB)
        sizes["teacher_asleep"] = int(VLLM_OVERHEAD_GB * GB)
    sizes["kv_cache"] = vllm_budget - sizes["vllm_weights"] - sizes["vllm_activations"] - sizes["vllm_overhead"]
    return sizes


def resident(p: PlanInputs) -> dict[str, tuple[str, ...]]:
    """Which components each phase holds (see the module docstring for the order)."""
    ref = ("reference",) if p.reference and not p.offload_ref else ()
    vllm = ("vllm_weights", "kv_cache", "vllm_activations", "vllm_overhead")
    weights_kept = not p.free_kv_cache or p.sleep_level == 0 or p.device_type == "cpu"
    train_vllm = ("vllm_weights",) * weights_kept + ("kv_cache",) * (not p.free_kv_cache)
    asleep = ("judges_asleep",) * bool(p.judges) + ("teacher_asleep",) * bool(p.teacher)
    phases = {
        "generate": ("trainer_params",) * (not p.offload_params) + ("optimizer",) * (not p.offload_optimizer)
        + ref + vllm + asleep,
        "sync": ("trainer_params",) + ("optimizer",) * (not p.offload_optimizer) + ref
        + ("vllm_weights", "vllm_overhead", "sync_buckets") + ("kv_cache",) * (not p.free_kv_cache),
        "train": ("trainer_params", "gradients", "optimizer", "activations", "fsdp_gathered") + ref
        + train_vllm + ("vllm_overhead",),
        "checkpoint": ("trainer_params", "optimizer", "optimizer_load") + ref + train_vllm + ("vllm_overhead",),
    }
    phases = {ph: held + asleep for ph, held in phases.items()}
    # generate -> the policy's engine sleeps -> the judges wake, score, sleep -> the teacher does
    # (rlcore/step/switch.py judging, rlcore/distill/teacher.py)
    scoring = (("trainer_params",) * (not p.offload_params) + ("optimizer",) * (not p.offload_optimizer)
               + ref + train_vllm + ("vllm_overhead",))
    if p.judges:
        phases["judge"] = scoring + ("judges",) + ("teacher_asleep",) * bool(p.teacher)
    if p.teacher:
        phases["teacher"] = scoring + ("teacher",) + ("judges_asleep",) * bool(p.judges)
    return phases


# ------------------------------------------------------------------------------- the plan

@dataclass
class MemoryPlan:
    inputs: PlanInputs
    phases: dict[str, dict[str, int]]  # phase -> component -> bytes (0 where not resident)
    kv: dict  # KV cache capacity against the replica's batch
    reserve_gb: float
    warnings: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def limit(self) -> int:
        return int((self.inputs.device_gb - self.reserve_gb) * GB)

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def kv_ok(self) -> bool:
        """vLLM refuses to start when its KV cache cannot hold one rollout.max_model_len sequence."""
        return self.kv["tokens"] >= self.inputs.max_model_len

    @property
    def fits(self) -> bool:
        return self.kv_ok and all(self.total(ph) <= self.limit for ph in self.phases)

    def shortfall(self) -> int:
        """Bytes missing: the worst phase's excess, plus the KV cache missing for one sequence."""
        over = max(self.total(ph) - self.limit for ph in self.phases)
        kv_missing = max(0, self.inputs.max_model_len - self.kv["tokens"]) * self.kv["bytes_per_token"]
        return max(0, over) + kv_missing

    def peak(self) -> tuple[str, int]:
        phase = max(self.phases, key=self.total)
        return phase, self.total(phase)

    def to_json(self) -> dict:
        p, s = self.inputs, self.inputs.shape
        dense, expert = s.counts()
        return {
            "model": {"arch": s.arch, "params": dense + expert, "expert_params": expert,
                      "vision_params": s.vision_params()},
            "world_size": p.world, "device_type": p.device_type, "device_gb": p.device_gb, "dtype": p.dtype,
            "reserve_gb": self.reserve_gb, "limit_gb": _gb(self.limit),
            "phases": {ph: {"components": {k: _gb(v) for k, v in self.phases[ph].items()},
                            "total_gb": _gb(self.total(ph)), "headroom_gb": _gb(self.limit - self.total(ph)),
                            "fits": self.total(ph) <= self.limit} for ph in self.phases},
            "kv_cache": {**self.kv, "gb": _gb(self.kv["bytes"])},
            "fits": self.fits, "warnings": self.warnings, "suggestions": self.suggestions,
        }


def _gb(nbytes: int) -> float:
    return round(nbytes / GB, 3)


def build_plan(p: PlanInputs, suggest: bool = True) -> MemoryPlan:
    sizes = component_bytes(p)
    sizes["kv_cache"] = max(0, sizes["kv_cache"])
    phases = {ph: {k: (sizes[k] if k in held else 0) for k in p.components} for ph, held in resident(p).items()}
    per_token = kv_bytes_per_token(p)
    in_flight = p.seqs_per_replica * p.oversample  # partial rollouts: more groups generate than train
    kv = {"bytes": sizes["kv_cache"], "bytes_per_token": per_token, "tokens": sizes["kv_cache"] // per_token,
          "sequences": sizes["kv_cache"] // per_token // p.seq_len,
          "batch_sequences": int(in_flight), "batch_tokens": int(in_flight * p.seq_len),
          # prefix caching shares a prompt's blocks among its n samples
          "batch_tokens_shared_prompts": int(in_flight / p.n * (p.prompt_len + p.n * p.response_len))}
    plan = MemoryPlan(p, phases, kv, RESERVE_GB.get(p.device_type, 0.0))
    plan.warnings = _kv_warnings(plan, suggest)
    if p.shape.uncounted_vision:
        plan.warnings.append(f"config.json has a vision tower (model_type {p.shape.uncounted_vision!r}) whose layout "
                             f"the plan does not know: its parameters and activations are not counted")
    if suggest and not plan.fits:
        plan.suggestions = suggest_fixes(plan)
    return plan


def _kv_warnings(plan: MemoryPlan, suggest: bool) -> list[str]:
    p, kv = plan.inputs, plan.kv
    if not plan.kv_ok:
        return [f"vLLM will not start: its KV cache ({_gb(kv['bytes'])} GB, {kv['tokens']} tokens) cannot hold one "
                f"rollout.max_model_len={p.max_model_len} sequence; raise rollout.gpu_memory_utilization or "
                f"rollout.tensor_parallel_size, or lower rollout.max_model_len"]
    if kv["tokens"] >= kv["batch_tokens"]:
        return []
    waves = math.ceil(kv["batch_tokens"] / max(1, kv["tokens"]))
    msg = (f"the KV cache holds {kv['sequences']} sequences of {p.seq_len} tokens, a replica generates "
           f"{kv['batch_sequences']} per step: up to {waves} waves (fewer when samples stop early or "
           f"share their prompt through prefix caching: {kv['batch_tokens_shared_prompts']:,} tokens)")
    if suggest:
        for u in (x / 100 for x in range(5, 96, 5)):
            q = build_plan(replace(p, gpu_memory_utilization=u), suggest=False)
            if u > p.gpu_memory_utilization and q.fits and q.kv["tokens"] >= kv["batch_tokens"]:
                return [f"{msg}; rollout.gpu_memory_utilization={u:.2f} holds the whole batch and still fits"]
    return [msg]


def _first_fit(label: str, variants: list[tuple[object, PlanInputs]]) -> list[tuple[str, PlanInputs]]:
    """The first variant that fits, else the one missing the fewest bytes (variants: closest first)."""
    plans = [(v, q, build_plan(q, suggest=False)) for v, q in variants]
    if not plans:
        return []
    fit = [x for x in plans if x[2].fits]
    v, q, _ = fit[0] if fit else min(plans, key=lambda x: x[2].shortfall())
    return [(label.format(v), q)]


def _candidates(p: PlanInputs) -> list[tuple[str, PlanInputs]]:
    """Single setting changes that lower some phase's peak, each as the re-planned inputs."""
    out = [(label, q) for cond, label, q in (
        (not p.offload_params, "offload.params=true", replace(p, offload_params=True)),
        (not p.offload_optimizer, "offload.optimizer=true", replace(p, offload_optimizer=True)),
        (p.reference and not p.offload_ref, "offload.ref=true", replace(p, offload_ref=True)),
        (not p.gradient_checkpointing, "model.gradient_checkpointing=true", replace(p, gradient_checkpointing=True)),
        (p.sleep_level == 0 and p.device_type != "cpu", "rollout.sleep_level=2", replace(p, sleep_level=2)),
        (not p.free_kv_cache, "rollout.free_kv_cache=true", replace(p, free_kv_cache=True)),
        (p.sync_bucket_mb > 64, "rollout.sync_bucket_mb=64", replace(p, sync_bucket_mb=64.0)),
    ) if cond]
    return out + _searched(p) + ([("algorithm.kl_loss_coef=0 (no reference model)", replace(p, reference=False))]
                                 if p.reference else [])


def _searched(p: PlanInputs) -> list[tuple[str, PlanInputs]]:
    """Settings with a range: the value closest to the current one that fits (else the best)."""
    micro = [(m, replace(p, micro_batch_size=m)) for m in range(p.micro_batch_size - 1, 0, -1)]
    utils = sorted((u / 100 for u in range(10, 96, 5) if abs(u / 100 - p.gpu_memory_utilization) > 1e-6),
                   key=lambda u: abs(u - p.gpu_memory_utilization))
    tps = [t for t in (2 ** k for k in range(1, 7))
           if p.tp < t <= (p.nproc_per_node or p.world) and p.world % t == 0]
    node = p.nproc_per_node
    worlds = [(f"--nnodes {p.world * k // node}" if node else f"world size {p.world * k}",
               replace(p, world=p.world * k)) for k in (2, 4)] if p.fsdp is None else []  # HSDP: more replicas
    # HSDP: bigger shard groups shard the trainer state over more ranks (null: all of them)
    fsdps = [(f, replace(p, fsdp=f)) for f in range(p.fsdp + 1, p.world + 1)
             if p.world % f == 0 and f % p.ulysses == 0 and f % p.ep == 0] if p.fsdp else []
    lp = [(m, replace(p, log_prob_micro_batch_size=m))
          for m in range((p.log_prob_micro_batch_size or 0) - 1, p.micro_batch_size - 1, -1)]
    return (_first_fit("algorithm.micro_batch_size={}", micro)
            + _first_fit("algorithm.log_prob_micro_batch_size={}", lp)
            + _first_fit("rollout.gpu_memory_utilization={:.2f}",
                         [(u, replace(p, gpu_memory_utilization=u)) for u in utils])
            + _first_fit("rollout.tensor_parallel_size={}", [(t, replace(p, tp=t)) for t in tps])
            + _first_fit("{} (more ranks shard the trainer state)", worlds)
            + _first_fit("parallel.fsdp_size={}", fsdps))


def _peak(plan: MemoryPlan) -> str:
    phase, peak = plan.peak()
    return f"peak {peak / GB:.2f} GB in {phase}"


def _key(label: str) -> str:
    return label.replace(" ", "=").split("=")[0]


def suggest_fixes(plan: MemoryPlan) -> list[str]:
    """Settings that make every phase fit: each single change that does, else a greedy
    combination (the change missing the fewest bytes first)."""
    tried = [(label, build_plan(q, suggest=False)) for label, q in _candidates(plan.inputs)]
    single = [f"{label}: fits ({_peak(q)})" for label, q in tried if q.fits]
    if single:
        return single
    chosen, current = [], plan
    for _ in range(5):
        tried = [(label, build_plan(q, suggest=False)) for label, q in _candidates(current.inputs)
                 if _key(label) not in {_key(c) for c in chosen}]
        if not tried:
            break
        label, best = min(tried, key=lambda lq: lq[1].shortfall())
        if best.shortfall() >= current.shortfall():
            break
        chosen.append(label)
        current = best
        if best.fits:
            return [f"no single change fits; together: {', '.join(chosen)} ({_peak(best)})"]
    return [f"no combination of the settings found fits ({', '.join(chosen) or 'none helps'} still misses "
            f"{_gb(current.shortfall())} GB): use devices with more memory or more of them"]


# ------------------------------------------------------------------------------- config, output

def plan_from_config(cfg, world_size: int, device_gb: float, device_type: str = "cuda", *,
                     nproc_per_node: int | None = None, shape: ModelShape | None = None) -> MemoryPlan:
    """The plan of ``cfg`` (an ``rlcore.config.Config``, resolved or not: its null/auto defaults are
    filled in for ``device_type`` by ``rlcore.config.resolve``) on ``world_size`` ranks of
    ``device_gb`` GB each; reads ``config.json`` from ``cfg.model.path`` unless ``shape`` is given."""
    from rlcore.config import resolve

    cfg = resolve(cfg, device_type)
    r, a, o = cfg.rollout, cfg.algorithm, cfg.offload
    # rollout.limit_mm_per_prompt null with image data: the trainer sets it from the data (1 image
    # or more); the plan assumes 1
    images = max(1, (r.limit_mm_per_prompt or {}).get("image", 1))
    p = PlanInputs(
        shape=shape or ModelShape.from_path(cfg.model.path), world=world_size, device_gb=float(device_gb),
        device_type=device_type, dtype=cfg.model.dtype, nproc_per_node=nproc_per_node,
        offload_params=o.params, offload_optimizer=o.optimizer, reference=a.kl_loss_coef > 0, offload_ref=o.ref,
        tp=r.tensor_parallel_size, gpu_memory_utilization=r.gpu_memory_utilization, sleep_level=r.sleep_level,
        free_kv_cache=r.free_kv_cache, sync_bucket_mb=r.sync_bucket_mb, micro_batch_size=a.micro_batch_size,
        log_prob_micro_batch_size=a.log_prob_micro_batch_size,
        log_prob_micro_batch_tokens=a.log_prob_micro_batch_tokens,
        prompt_len=cfg.data.max_prompt_length, max_model_len=r.max_model_len,
        response_len=(r.max_model_len - cfg.data.max_prompt_length if r.agent.enable  # an agent's segment: the context
                      else r.multi_turn.max_total_tokens if r.multi_turn.enable else r.max_response_length),
        gradient_checkpointing=cfg.model.gradient_checkpointing, prompts_per_step=cfg.trainer.prompts_per_step,
        n=r.n, max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_num_seqs,
        graphs=not r.enforce_eager, ep=cfg.parallel.ep_size, freeze_vision=cfg.model.freeze_vision_tower,
        images_per_prompt=(images if cfg.data.image_key else 0),
        vllm_images=None if r.limit_mm_per_prompt is None else r.limit_mm_per_prompt.get("image", 0),
        lora_rank=cfg.lora.rank if cfg.lora.enabled else 0,
        optimizer_bytes=optimizer_bytes(cfg.optim.optimizer, cfg.optim.state_dtype, cfg.optim.kahan_summation),
        optimizer_load_bytes=optimizer_load_bytes(cfg.optim.optimizer, cfg.optim.state_dtype, cfg.optim.kahan_summation),
        judges=tuple(JudgePlan(ModelShape.from_path(j.path), j.gpu_memory_utilization, j.sleep_level or 1,
                               DTYPE_BYTES[j.dtype or r.dtype or cfg.model.dtype]) for j in cfg.reward.judges()),
        teacher=teacher_plan(cfg, DTYPE_BYTES), oversample=r.partial.oversample if r.partial.enable else 1.0,
        ulysses=cfg.parallel.ulysses_size, share_prompt=bool(cfg.algorithm.share_prompt),
        fsdp=cfg.parallel.fsdp_size)
    return build_plan(p)


def device_total_gb(device_type: str) -> float | None:
    """This process's device memory in GB (what the trainer passes as device_gb); None on CPU."""
    import torch

    accel = getattr(torch, device_type, None) if device_type != "cpu" else None
    return None if accel is None else accel.get_device_properties(accel.current_device()).total_memory / GB


def format_plan(plan: MemoryPlan) -> str:
    """A compact table: one row per component, one column per phase (GB = 2^30 bytes per rank)."""
    p, s = plan.inputs, plan.inputs.shape
    nnodes = p.world // p.nproc_per_node if p.nproc_per_node else 0
    nodes = f" ({nnodes} node{'s' * (nnodes > 1)} x {p.nproc_per_node})" if nnodes else ""
    vision = (f" ({s.vision_params() / 1e9:.2f}B vision{', frozen' if p.freeze_vision else ''})"
              if s.vision else "")
    lines = [
        f"memory plan per rank, GB = 2^30 bytes: {s.arch} {s.params / 1e9:.2f}B params{vision}, {p.dtype}, "
        f"world {p.world}{nodes}, tp {p.tp}, {p.device_type} {p.device_gb:g} GB",
        f"{'component':<18}" + "".join(f"{ph:>11}" for ph in plan.phases),
    ]
    for comp in p.components:
        lines.append(f"{comp:<18}" + "".join(f"{plan.phases[ph][comp] / GB:>11.2f}" for ph in plan.phases))
    lines.append(f"{'total':<18}" + "".join(f"{plan.total(ph) / GB:>11.2f}" for ph in plan.phases))
    lines.append(f"{'fits':<18}" + "".join(f"{'yes' if plan.total(ph) <= plan.limit else 'NO':>11}"
                                           for ph in plan.phases))
    lines += host_lines(p, GB)
    lines.append(f"limit {plan.limit / GB:.2f} GB = {p.device_gb:g} - {plan.reserve_gb:g} reserve (device context, "
                 f"communicators, fragmentation)")
    kv = plan.kv
    lines.append(f"KV cache: {kv['bytes'] / GB:.2f} GB = {kv['tokens']:,} tokens ({kv['bytes_per_token'] // 1024} KiB "
                 f"per token per rank) = {kv['sequences']} sequences of {p.seq_len}; a replica generates "
                 f"{kv['batch_sequences']} sequences = {kv['batch_tokens']:,} tokens per step")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines += [f"to fit: {x}" for x in plan.suggestions]
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"verdict: {verdict} in {p.device_gb:g} GB ({_peak(plan)}, headroom "
                 f"{(plan.limit - plan.peak()[1]) / GB:.2f} GB)")
    return "\n".join(lines)
