"""Everything checked before any model loads, on every rank: the config against the world size,
files, the checkpoint to resume, the tokenizer and every data row. A mistake exits with code 2."""

from __future__ import annotations

import dataclasses
import os

from rlcore import agent
from rlcore.config import Config, ConfigError, check, fail
from rlcore.dist import detect_device, node_of_each_rank
from rlcore.errors import describe_errno
from rlcore.hf_folder import folder_problem, read_config
from rlcore.judge.config import check_judge_data
from rlcore.rollout import routing as rollout_routing
from rlcore.run import checkpoint, run_config, storage
from rlcore.run.ownership import claim_output_dir
from rlcore.task import rewards, verl_rows
from rlcore.task.prompts import load_prompts


def _print_main(message: str) -> None:
    print(message, flush=True)


def preflight(cfg: Config, rank: int, world_size: int):
    """Every check that needs no model, on every rank: config against the world size and the nodes,
    files, the checkpoint to resume, the tokenizer (and image processor), every data row. A mistake
    exits with code 2 here. Returns (tokenizer, image processor or None, prompts, checkpoint to resume)."""
    nodes = node_of_each_rank()  # collective: before any check that could stop one rank alone
    try:
        validate_against_world(cfg, world_size, nodes)
        rollout_routing.check_config(cfg, detect_device(cfg.parallel.device)[0])  # r3: vLLM's own verdict
        claim_output_dir(cfg.trainer.output_dir, rank)  # before anything in it is read or written
        storage.check_output_dir(cfg, rank, world_size)  # room for a checkpoint (and the HF export when one is due)
        resume_from = checkpoint.find_resume(cfg.trainer.output_dir, cfg.checkpoint.resume,
                                             report=_print_main if rank == 0 else None)
        resume_note = None
        if resume_from is not None:
            checkpoint.validate_resume(resume_from, rank, world_size)
            resume_note = run_config.check_resume(resume_from, cfg)  # a checkpoint of another run: exit 2
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        processor = load_vision(cfg) if cfg.data.image_key else None
        prompts, stats = load_prompts(cfg.data.train_files, cfg.data, tokenizer, processor,
                                      agent.renderer_for(cfg, tokenizer))
        check_image_limit(cfg, prompts)
        check_judge_data(cfg.reward.judges(), [p.row for p in prompts])  # the templates' fields
        verl_note = check_verl_rows(cfg)
        epochs_note = resolve_total_steps(cfg, len(prompts))  # before the engines: the LR schedule follows it
    except ConfigError as e:
        fail(str(e) + intact_note(cfg))
    except OSError as e:  # a data file that vanished or cannot be read while it was read
        fail(unreadable(e) + intact_note(cfg))
    if rank == 0:
        note = cpu_bf16_note(detect_device(cfg.parallel.device)[0], (cfg.model.dtype, cfg.rollout.dtype),
                             cpu_bf16_isa())
        if note:
            print(f"warning: {note}", flush=True)
        images = sum(len(p.images or []) for p in prompts)
        cut = stats.get("data/truncated_too_long")
        too_long = (f"{stats['data/filtered_too_long']} over data.max_prompt_length filtered" if cut is None else
                    f"{cut} over data.max_prompt_length truncated, data.truncation={cfg.data.truncation}")
        print(f"train data: {stats['data/prompts']} prompts{f' with {images} images' if images else ''} "
              f"({stats['data/bad_rows']} bad rows skipped, {too_long})", flush=True)
        for note in (resume_note, verl_note, epochs_note, checkpoint_note(cfg)):
            if note:
                print(note, flush=True)
    return tokenizer, processor, prompts, resume_from


def check_verl_rows(cfg: Config) -> str | None:
    """The verl component (reward.components, val.reward_components) has a scorer for every row's
    data_source (ConfigError naming the first row without one); returns the "verl rows: ..." line
    (None when neither the rows nor the reward are verl's: nothing is read again)."""
    found = verl_rows.detect(cfg.data.train_files, cfg.data.prompt_key)
    val_components = cfg.val.reward_components or cfg.reward.components
    scored = "verl" in cfg.reward.components
    if not (found or scored or "verl" in val_components):
        return None
    counts = verl_rows.sources(cfg.data.train_files)
    if scored:
        verl_rows.check_sources(counts, "reward.components")
    if cfg.data.val_files and "verl" in val_components:
        verl_rows.check_sources(verl_rows.sources(cfg.data.val_files),
                                "val.reward_components" if cfg.val.reward_components else "reward.components")
    return verl_rows.startup_line(found, cfg.data, cfg.reward.components, counts)


def unreadable(e: OSError) -> str:
    return (f"{e.filename or 'a file'} cannot be read: {describe_errno(e.errno, e.strerror)}; check that it exists "
            f"and can be read (the files of data.train_files / data.val_files and the images their rows name are "
            f"read whole at start-up)")


def intact_note(cfg: Config) -> str:
    """For a stopped run started again (a data file gone, a disk remounted read-only): the
    checkpoint it would resume from is untouched by the refusal; '' when there is none."""
    if cfg.checkpoint.resume != "auto":
        return ""
    try:
        found = checkpoint.find_resume(cfg.trainer.output_dir, "auto")
    except (ConfigError, OSError):
        return ""
    return (f" (nothing was written: checkpoint {found} is intact, and the run resumes from it once this is "
            f"fixed)") if found else ""


def epochs_to_steps(epochs: int, prompts: int, per_step: int) -> int:
    """trainer.total_epochs -> total_steps: ceil(epochs x prompts / per_step). PromptSampler runs the
    epochs into one another (a batch crossing an epoch's end takes its rest from the next epoch's
    order), so this many steps draw every prompt ``epochs`` times, the last step topping up with
    fewer than ``per_step`` prompts of one more epoch. verl drops each epoch's partial batch instead:
    epochs x (prompts // per_step) steps; both agree when ``per_step`` divides ``prompts``."""
    return -(-epochs * prompts // per_step)


def resolve_total_steps(cfg: Config, num_prompts: int) -> str | None:
    """trainer.total_epochs set: fill in trainer.total_steps from the training prompts kept after
    filtering (in place: the one Config the run builds everything from after preflight) and return
    the start-up line; None when total_epochs is not set. Both set and disagreeing: ConfigError."""
    t = cfg.trainer
    if t.total_epochs is None:
        return None
    steps = epochs_to_steps(t.total_epochs, num_prompts, t.prompts_per_step)
    check(t.total_steps is None or t.total_steps == steps, "trainer.total_steps", t.total_steps,
          f"trainer.total_epochs={t.total_epochs} over the {num_prompts} training prompts at trainer.prompts_per_step="
          f"{t.prompts_per_step} is {steps} steps; set one of the two to null (with both, they must agree)")
    t.total_steps = steps
    extra = t.total_epochs * num_prompts % t.prompts_per_step
    tail = f"; the last step draws {t.prompts_per_step - extra} prompts of one more epoch" if extra else ""
    return (f"trainer.total_epochs {t.total_epochs} -> total_steps {steps} ({num_prompts} prompts, "
            f"{t.prompts_per_step} per step){tail}")


def checkpoint_note(cfg: Config) -> str | None:
    """The start-up line of checkpoint.save_every=-1 (never save); None otherwise."""
    c = cfg.checkpoint
    if c.save_every != -1:
        return None
    hf = (f"; checkpoint.save_hf_final=true still exports {os.path.join(cfg.trainer.output_dir, 'hf_final')} at "
          f"the end (an HF model for inference, not a checkpoint)" if c.save_hf_final else "")
    return ("checkpoint.save_every=-1: this run writes no checkpoint (periodic, final, on preemption or divergence); "
            f"a restart cannot resume it{hf}")


def cpu_bf16_isa() -> str | None:
    """The instructions that make bfloat16 fast on this CPU: ``amx`` (vLLM then runs its AMX attention,
    vllm 0.32.0 v1/attention/backends/cpu_attn.py:533-545, and oneDNN its AMX GEMMs), ``avx512_bf16``,
    ``arm_bf16`` (vLLM's own test for Arm, model_executor/layers/mamba/ops/cpu/gdn_attention.py:127-131),
    or None (bf16 is emulated: about 4x slower than float32 in vLLM, docs/platform.md)."""
    import platform

    import torch

    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    arm = platform.machine().lower() in ("aarch64", "arm64")
    return "arm_bf16" if arm and torch.cpu.get_capabilities().get("bf16", False) else None


def cpu_bf16_note(device_type: str, dtypes, isa: str | None) -> str | None:
    """A warning when bfloat16 runs on a CPU without bf16 instructions (fast with them: on AMX, 24-token
    generation of the SmolLM2 example is 2.7x faster than float32; docs/learning.md section 5)."""
    if device_type != "cpu" or "bfloat16" not in dtypes or isa is not None:
        return None
    return ("model.dtype/rollout.dtype=bfloat16 on a CPU without AMX or AVX512-BF16: bfloat16 is emulated "
            "there and generates about 4x slower than float32; set model.dtype: float32 and rollout.dtype: null")


def prepare_scoring(cfg: Config, tokenizer, rank: int, processor=None):
    """The reward scorer (``scorer.for_validation``: val.reward_components' one) and the tokenized
    validation prompts (None without data.val_files)."""
    try:
        key = cfg.data.answer_key
        scorer = rewards.Scorer(cfg.reward, answer_key=key)
        scorer.for_validation = rewards.Scorer(cfg.reward, cfg.val.reward_components, answer_key=key) \
            if cfg.val.reward_components else scorer
        val_prompts = None
        if cfg.data.val_files:
            val_prompts = load_prompts(cfg.data.val_files, cfg.data, tokenizer, processor,
                                       agent.renderer_for(cfg, tokenizer))[0]
            check_image_limit(cfg, val_prompts)
            check_judge_data(cfg.reward.judges(), [p.row for p in val_prompts])
    except (ConfigError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(unreadable(e) + intact_note(cfg))
    if rank == 0 and val_prompts:
        print(f"validation data: {len(val_prompts)} prompts", flush=True)
    return scorer, val_prompts


def load_vision(cfg: Config):
    """The model folder's image processor (data.image_key is set): a vision-language model only."""
    from rlcore.task.images import VisionProcessor

    config = _read_config(cfg.model.path)
    check("vision_config" in config, "data.image_key", cfg.data.image_key,
          f"model.path={cfg.model.path!r} is a text-only model (no vision_config in its config.json); use a "
          "vision-language model (Qwen2.5-VL, Qwen3-VL) or unset data.image_key")
    try:
        return VisionProcessor(cfg.model.path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"model.path={cfg.model.path!r} has no usable image processor ({type(e).__name__}: {e}); "
                          "the folder needs the model's preprocessor/processor config files") from e


def resolve_image_limit(cfg: Config, *prompt_sets) -> Config:
    """rollout.limit_mm_per_prompt null with image data -> {image: the most images a prompt has,
    video: 0}: vLLM budgets its encoder cache for that many, not for its default of hundreds."""
    if cfg.rollout.limit_mm_per_prompt is not None or not cfg.data.image_key:
        return cfg
    most = max((len(p.images or []) for prompts in prompt_sets if prompts for p in prompts), default=0)
    limit = {"image": max(most, 1), "video": 0}
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, limit_mm_per_prompt=limit))


def check_image_limit(cfg: Config, prompts: list) -> None:
    """rollout.limit_mm_per_prompt, when set, must admit the most images any prompt has."""
    most = max((len(p.images or []) for p in prompts), default=0)
    limit = cfg.rollout.limit_mm_per_prompt
    if limit is not None and most > limit.get("image", 0):
        raise ConfigError(f"rollout.limit_mm_per_prompt={limit} is too small: a prompt has {most} images; set "
                          f"rollout.limit_mm_per_prompt.image to at least {most} (or null: from the data)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    fix = "the folder needs the model's tokenizer files (tokenizer.json and tokenizer_config.json)"
    # transformers 5 builds an empty tokenizer (vocabulary of 1) from a folder without these files.
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path={path!r} is invalid: no tokenizer there; {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model.path={path!r} is invalid: no tokenizer loads from it ({type(e).__name__}); {fix}") from e
    if len(tokenizer) < 2:
        raise ConfigError(f"model.path={path!r} is invalid: its tokenizer has an empty vocabulary; {fix}")
    return tokenizer


def validate_against_world(cfg: Config, world_size: int, nodes: list[int] | None = None) -> None:
    """Checks across sections, against the world size, the nodes (``nodes[rank]``: the torchrun
    agent of each rank; None: one node) and the files on disk; before any model loads."""
    tp = cfg.rollout.tensor_parallel_size
    check(world_size % tp == 0, "rollout.tensor_parallel_size", tp,
          f"it must divide the world size {world_size} (e.g. 1 or {world_size})")
    check_tp_inside_nodes(tp, nodes or [0] * world_size)
    dp = world_size // tp
    check(cfg.trainer.prompts_per_step % dp == 0, "trainer.prompts_per_step", cfg.trainer.prompts_per_step,
          f"it must be divisible by the {dp} rollout replicas (world size / tensor_parallel_size)")
    per_rank = cfg.trainer.prompts_per_step // dp * cfg.rollout.n
    check(per_rank % tp == 0, "rollout.n", cfg.rollout.n,
          f"prompts per replica x rollout.n = {per_rank} must split evenly over tensor_parallel_size={tp}")
    per_rank //= tp
    check(per_rank % cfg.algorithm.mini_batches == 0, "algorithm.mini_batches", cfg.algorithm.mini_batches,
          f"it must divide the {per_rank} sequences each rank trains on per step")
    check(len(cfg.data.train_files) > 0, "data.train_files", cfg.data.train_files,
          "list at least one JSONL or Parquet file")
    check(folder_problem(cfg.model.path) is None, "model.path", cfg.model.path, folder_problem(cfg.model.path) or "")
    check(any(f.endswith(".safetensors") for f in os.listdir(cfg.model.path)), "model.path", cfg.model.path,
          "it holds no *.safetensors weights; weights are read only from safetensors (re-save the model with "
          "save_pretrained(..., safe_serialization=True))")
    check_remote_code(cfg)  # before anything imports the folder's code (VeOmni would, unasked)
    _check_experts(cfg, world_size)
    _check_sequence_parallel(cfg, world_size)
    _check_fsdp_size(cfg, world_size)
    context = _model_context(cfg.model.path)
    check(context is None or cfg.rollout.max_model_len <= context, "rollout.max_model_len", cfg.rollout.max_model_len,
          f"the model's context (max_position_embeddings in config.json) is {context}; use at most that")
    check(not os.path.exists(cfg.trainer.output_dir) or os.path.isdir(cfg.trainer.output_dir),
          "trainer.output_dir", cfg.trainer.output_dir, "it exists and is not a folder; choose a folder path")
    for i, path in enumerate(cfg.data.train_files + cfg.data.val_files):
        check(os.path.isfile(path), "data.train_files" if i < len(cfg.data.train_files) else "data.val_files",
              path, "the file does not exist")
    check(cfg.algorithm.overlong_buffer_len < cfg.rollout.max_response_length, "algorithm.overlong_buffer_len",
          cfg.algorithm.overlong_buffer_len,
          f"it must be < rollout.max_response_length={cfg.rollout.max_response_length}")
    needed = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    check(needed <= cfg.rollout.max_model_len, "rollout.max_model_len", cfg.rollout.max_model_len,
          f"it must hold data.max_prompt_length + rollout.max_response_length = {needed}")
    _validate_val(cfg)


def check_tp_inside_nodes(tp: int, nodes: list[int]) -> None:
    """vLLM's tensor-parallel groups are blocks of ``tp`` consecutive ranks (vllm 0.32.0
    distributed/parallel_state.py:2135-2147, ``all_ranks.view(-1, tp)``), and torchrun numbers each
    agent's ranks as one block (torch/distributed/elastic/agent/server/api.py:585-609). A group that
    spans two nodes would run vLLM's per-token all-reduces over the network (on CPU, its shared-memory
    communicator cannot even open): refused, naming the ranks and nodes."""
    for first in range(0, len(nodes), tp):
        group = nodes[first:first + tp]
        if len(set(group)) > 1:
            per_node = sorted({nodes.count(n) for n in set(nodes)})
            raise ConfigError(
                f"rollout.tensor_parallel_size={tp} puts ranks {first}-{first + tp - 1} of one vLLM "
                f"tensor-parallel group on nodes {sorted(set(group))} (torchrun agents of {per_node} "
                f"rank(s) each): a tensor-parallel group must stay inside a node; use a tensor_parallel_size "
                f"that divides the ranks per node, or more ranks per node (--nproc_per_node)")


def check_remote_code(cfg: Config) -> None:
    """Model folders with their own code (config.json auto_map) against model.trust_remote_code
    (rlcore.engine.remote_code.refusal): the policy's, each judge's, the teacher's."""
    from rlcore.engine.remote_code import refusal

    folders = [("model.path", cfg.model.path, True)] + [("reward.models.path", j.path, False)
                                                        for j in cfg.reward.judges()]
    if cfg.distill.teacher:
        folders.append(("distill.teacher", cfg.distill.teacher, False))
    for key, path, policy in folders:
        problem = refusal(path, key, cfg.model.trust_remote_code, policy)
        if problem:
            raise ConfigError(problem)


def _check_experts(cfg: Config, world_size: int) -> None:
    from rlcore.hf_folder import model_num_experts

    ep, experts = cfg.parallel.ep_size, model_num_experts(cfg.model.path)
    check(world_size % ep == 0, "parallel.ep_size", ep, f"it must divide the world size {world_size}")
    if ep > 1:
        check(experts > 0, "parallel.ep_size", ep, "the model at model.path has no experts (a dense model): use 1")
        fits = [str(d) for d in range(2, experts + 1) if experts % d == 0 and world_size % d == 0]
        check(experts % ep == 0, "parallel.ep_size", ep,
              f"it must divide the model's {experts} experts (e.g. {', '.join(fits) or 1})")


def _check_sequence_parallel(cfg: Config, world_size: int) -> None:
    """parallel.ulysses_size against the world, the model's heads and what the Ulysses path takes
    (rlcore.engine.ulysses), before anything loads."""
    from rlcore.engine.ulysses import VL_FAMILIES

    u = cfg.parallel.ulysses_size
    if u == 1:
        return
    field = "parallel.ulysses_size"
    fits = [str(d) for d in range(1, world_size + 1) if world_size % d == 0]
    check(world_size % u == 0, field, u, f"it must divide the world size {world_size} (e.g. {', '.join(fits)})")
    config = _read_config(cfg.model.path)
    text = config.get("text_config") or config
    heads = int(text.get("num_attention_heads", 0))
    kv = int(text.get("num_key_value_heads", heads) or heads)
    check(heads % u == 0, field, u, f"it must divide the model's {heads} attention heads (each rank attends with "
          f"heads / ulysses_size of them)")
    check(kv % u == 0 or u % kv == 0, field, u, f"it and the model's {kv} key/value heads must divide one another")
    if "vision_config" in config:  # the ViT runs 1/U of the patches and all-to-alls its heads too
        family = config.get("model_type")
        check(family in VL_FAMILIES, field, u, f"a {family} policy under sequence parallelism is not "
              f"supported (its vision tower has no Ulysses path here; {', '.join(VL_FAMILIES)} have one); use 1")
        vit_heads = int(config["vision_config"].get("num_heads", 0))
        check(vit_heads % u == 0, field, u, f"it must divide the vision tower's {vit_heads} attention heads too")
    # What resolve produced: a flash kernel runs VeOmni's Ulysses flash path, sdpa the project's own
    # (rlcore.engine.ulysses.attention_for); eager has neither.
    check(cfg.model.attn_implementation != "eager", field, u,
          "the Ulysses path attends through VeOmni's flash kernels or its own sdpa, not eager; set "
          "model.attn_implementation to auto (the device's kernel) or sdpa, or ulysses_size 1")


def _check_fsdp_size(cfg: Config, world_size: int) -> None:
    """parallel.fsdp_size (HSDP, rlcore.engine.build.mesh_sizes) against what VeOmni 0.1.12's mesh
    takes: dp_replicate x dp_shard = dp (veomni/distributed/parallel_state.py:99-102), the shard
    group dp_shard x ulysses (:597-610), and ep_size a factor of that group (:633-636)."""
    f, u, ep = cfg.parallel.fsdp_size, cfg.parallel.ulysses_size, cfg.parallel.ep_size
    if f is None:
        return
    fits = [str(d) for d in range(1, world_size + 1) if world_size % d == 0 and d % u == 0 and d % ep == 0]
    check(world_size % f == 0, "parallel.fsdp_size", f,
          f"it must divide the world size {world_size} (e.g. {', '.join(fits)}; null = {world_size}, plain FSDP); "
          "VeOmni needs dp_replicate x dp_shard = dp (veomni/distributed/parallel_state.py:99)")
    check(f % u == 0, "parallel.fsdp_size", f,
          f"it must be a multiple of parallel.ulysses_size {u} (e.g. {', '.join(fits)}): VeOmni shards over "
          "dp_shard x ulysses (veomni/distributed/parallel_state.py:597-610)")
    check(f % ep == 0, "parallel.fsdp_size", f,
          f"it must be a multiple of parallel.ep_size {ep} (e.g. {', '.join(fits)}): VeOmni asserts ep_size is a "
          "factor of the shard group (veomni/distributed/parallel_state.py:633-636)")


def _read_config(model_path: str) -> dict:
    try:
        config = read_config(model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={model_path!r} is invalid: its config.json does not parse as JSON "
                          f"({e}); re-export the model folder") from e
    return config if isinstance(config, dict) else {}


def _model_context(model_path: str) -> int | None:
    """max_position_embeddings of the model's config.json, or of its text model's (vision-language
    models nest it under text_config); None when it does not say."""
    config = _read_config(model_path)
    value = config.get("max_position_embeddings", (config.get("text_config") or {}).get("max_position_embeddings"))
    return value if isinstance(value, int) else None


def _validate_val(cfg: Config) -> None:
    t = cfg.trainer
    if t.val_every or t.val_before_train:
        check(len(cfg.data.val_files) > 0, "data.val_files", cfg.data.val_files,
              "validation is on (trainer.val_every / trainer.val_before_train): list at least one file, "
              "or set trainer.val_every=0 and trainer.val_before_train=false")
    needed = cfg.data.max_prompt_length + (cfg.val.max_response_length or cfg.rollout.max_response_length)
    check(needed <= cfg.rollout.max_model_len, "val.max_response_length", cfg.val.max_response_length,
          f"data.max_prompt_length + val.max_response_length = {needed} must fit rollout.max_model_len="
          f"{cfg.rollout.max_model_len}")
