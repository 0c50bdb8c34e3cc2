"""A tiny random Qwen3-VL-MoE (builder) and the torchrun worker of tests/test_vl_moe.py.

Builder: ``make_tiny_vl_moe_model(out_dir)``.
Worker:  torchrun --nproc_per_node=2 tests/workers/vl_moe.py MODEL_DIR INPUTS_PT OUT_DIR
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import os


def make_tiny_vl_moe_model(out_dir: str, *, hidden_size: int = 64, num_layers: int = 2, head_dim: int = 32,
                           num_experts: int = 4, top_k: int = 2, moe_intermediate_size: int = 96,
                           vision_depth: int = 2, vision_hidden: int = 64,
                           image_pixels: tuple[int, int] = (32 * 32, 128 * 128), seed: int = 0,
                           original_layout: bool = True) -> str:
    """A randomly initialised Qwen3-VL-MoE with its processor as an HF folder (fp32 safetensors):
    ``rlcore.demo.vl.make_tiny_vl_model``'s tokenizer, chat template, processor and vision tower,
    with a mixture-of-experts text model (every layer sparse).

    ``original_layout``: the experts are written as the released Qwen3-VL-MoE checkpoints hold
    them, ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` and ``mlp.experts.down_proj`` ``[E, I, H]``
    (what vLLM's loader expects, see tests/test_vl_moe.py); transformers 5.19's ``save_pretrained``
    writes its in-memory ``[E, 2I, H]`` / ``[E, H, I]`` instead. ``moe_intermediate_size`` must
    differ from ``hidden_size`` and ``2 * moe_intermediate_size`` too: the loaders tell the two
    layouts apart by shape only (a square expert tensor is silently transposed or not). It must be
    a multiple of 32 (vLLM's CPU MoE pads it otherwise), as must ``hidden_size``."""
    import torch
    from transformers import (Qwen2VLImageProcessor, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    from rlcore.demo.vl import CHAT_TEMPLATE, SPECIAL, VOCAB, make_vl_tokenizer

    if moe_intermediate_size in (hidden_size, hidden_size // 2) or hidden_size % 32 or moe_intermediate_size % 32:
        raise ValueError(f"moe_intermediate_size {moe_intermediate_size} with hidden_size {hidden_size}: "
                         f"need I != H, 2I != H, both multiples of 32")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = make_vl_tokenizer(out_dir)
    ids = {t: VOCAB.index(t) for t in SPECIAL}
    text = dict(vocab_size=len(VOCAB), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                max_position_embeddings=1024, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [6, 5, 5], "mrope_interleaved": True},  # sums to head_dim / 2
                pad_token_id=ids["<pad>"], eos_token_id=ids["<|im_end|>"], bos_token_id=None, dtype="float32")
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                  out_hidden_size=hidden_size, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=64, deepstack_visual_indexes=[vision_depth - 1])
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    if original_layout:
        from safetensors.torch import load_file, save_file

        path = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(path)
        for name in tensors:
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    lo, hi = image_pixels
    image_proc = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                       min_pixels=lo, max_pixels=hi, size={"shortest_edge": lo, "longest_edge": hi})
    video_proc = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    Qwen3VLProcessor(image_processor=image_proc, tokenizer=tokenizer, video_processor=video_proc,
                     chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------- the worker

LR = 1e-2  # one AdamW step moves every weight by ~LR: the rollout's log-probs move visibly
LIMITS = {"image": 2, "video": 0}


QUESTION = "<|im_start|> user {images} what colour is the shape ? <|im_end|> <|im_start|> assistant"
IMAGE = "<|vision_start|> <|image_pad|> <|vision_end|>"


def rollout_inputs(rank: int) -> tuple[list[list[int]], list]:
    """Two 1-image prompts, a 2-image prompt and a text prompt (as tests/workers/vl_rollout_worker.py);
    the shapes move with the rank, so the two engines get different images."""
    from PIL import Image, ImageDraw

    from rlcore.demo.vl import COLOURS, VOCAB

    def image(colour, box):
        im = Image.new("RGB", (96, 96), (255, 255, 255))  # 96 x 96 = 9 image tokens
        ImageDraw.Draw(im).rectangle(box, fill=COLOURS[colour])
        return im

    def prompt(num_images):
        ids = {w: i for i, w in enumerate(VOCAB)}
        return [ids[w] for w in QUESTION.format(images=" ".join([IMAGE] * num_images)).split()]

    o = 5 * rank
    images = [[image("red", (10 + o, 10, 60 + o, 50))], [image("blue", (30, 20 + o, 90, 70 + o))],
              [image("green", (5, 5 + o, 40, 40 + o)), image("yellow", (50 + o, 40, 90, 90))], None]
    return [prompt(1), prompt(1), prompt(2), prompt(0)], images


class Reference:
    """transformers' Qwen3-VL-MoE in fp32 with the folder's image processor (the scoring of
    tests/workers/vl_rollout_worker.py's Reference)."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoProcessor, Qwen3VLMoeForConditionalGeneration

        self.model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.image_processor = AutoProcessor.from_pretrained(model_dir).image_processor
        self.image_token = int(self.model.config.image_token_id)
        self.merge = int(self.model.config.vision_config.spatial_merge_size)

    def logprobs(self, ids: list[int], images: list | None, response: list[int]):
        """log_softmax(logits) at the response tokens: the prompt with its images (each image token
        expanded to ``grid.prod() // merge**2``), then the response through the KV cache (to vLLM a
        sampled ``<|image_pad|>`` is text; one forward over both would take it for an image slot)."""
        import torch

        self.model.model.rope_deltas = None  # the previous prompt's M-RoPE offset (transformers caches it)
        vision, expanded = {}, list(ids)
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            counts = iter((out["image_grid_thw"].prod(-1) // self.merge**2).tolist())
            expanded = [u for t in ids for u in ([t] * next(counts) if t == self.image_token else [t])]
            vision = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        x = torch.tensor([expanded])
        if vision:
            vision["mm_token_type_ids"] = (x == self.image_token).int()
        with torch.no_grad():
            out = self.model(input_ids=x, use_cache=True, **vision)
            logits = [out.logits[0, -1:]]
            if len(response) > 1:
                logits.append(self.model(input_ids=torch.tensor([response[:-1]]), past_key_values=out.past_key_values,
                                         use_cache=True).logits[0])
        lp = torch.log_softmax(torch.cat(logits).float(), dim=-1)
        return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]

    def max_diff(self, prompts, images, samples) -> float:
        """Max |vLLM logprob - transformers logprob| over every sampled token."""
        import torch

        return max((self.logprobs(ids, imgs, s.response_ids) - torch.tensor(s.logprobs)).abs().max().item()
                   for ids, imgs, per in zip(prompts, images, samples) for s in per)


def _experts_slot(policy) -> str | None:
    """The implementation bound to the ``moe_experts`` OpSlot of the policy's experts module."""
    import sys

    experts = next(m for m in policy.model.modules() if type(m).__name__.endswith("TextExperts"))
    for cls in type(experts).__mro__:  # FSDP2 wraps the experts in a class of its own
        slot = getattr(sys.modules[cls.__module__], "veomni_moe_experts_forward", None)
        if slot is not None:
            return slot._impl_name
    return None


def replay_row(policy, row, info):
    """Routing replay of the test's forced rows over this rank's packed row (keys = positions):
    a pre-hook on every experts module checks the indices it gets. Returns the counts and
    metrics, the replayed log-probs and a plain forward's after it."""
    import torch

    rows, keys = row["replay_rows"], torch.arange(row["input_ids"].shape[1])
    blocks = [m for m in policy.model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    counts = {"tokens": 0, "mismatched": 0}

    def check(layer):
        def hook(_module, args):
            if policy.replay.mode == "replay":
                counts["tokens"] += len(args[1])
                counts["mismatched"] += int((args[1].cpu() != rows[policy.replay.keys.cpu(), layer]).any(-1).sum())
        return hook
    handles = [b.experts.register_forward_pre_hook(check(i)) for i, b in enumerate(blocks)]

    def forward(**kw):
        return policy.forward_logprobs(row["input_ids"], row["position_ids"], row["labels"], grad=False,
                                       select=row["select"], mm=row["mm"], **kw)[0][0]
    with policy.routing("replay", (keys, rows, torch.zeros(0, dtype=torch.long))):
        replayed = forward(token_keys=keys[None])
    for h in handles:
        h.remove()
    image_token = policy.model.config.image_token_id
    out = {**counts, "image_tokens": int((row["input_ids"] == image_token).sum()),
           "metrics": policy.routing_metrics()}
    return out, replayed, forward()


def main() -> None:
    import json
    import sys
    import time

    import rlcore  # noqa: F401  (torchvision shim first)
    import torch
    import torch.distributed as dist

    from rlcore.dist import init_distributed

    model_dir, inputs, out = sys.argv[1], sys.argv[2], sys.argv[3]
    info = init_distributed("cpu")
    torch._C.set_num_threads(1)
    rows = torch.load(inputs, weights_only=False)["rows"]
    row = rows[info.rank]
    results, tensors, times = {}, {}, {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        times[name] = round(time.perf_counter() - clock, 2)
        clock = time.perf_counter()

    # --- the policy: VeOmni's Qwen3-VL-MoE, FSDP2 + EP 2, torch_ep experts ----------------------
    from rlcore.engine_veomni import VeOmniPolicy

    policy = VeOmniPolicy(model_dir, info, lr=LR, grad_clip=None, ep_size=2, moe_implementation="torch_ep",
                          routing_replay=True)
    results["describe"] = policy.describe()
    results["experts_slot"] = _experts_slot(policy)
    results["expert_layout"] = policy.expert_layout.describe()
    results["local_experts"] = {n.rsplit(".", 1)[1]: list(p.to_local().shape)
                                for n, p in policy.model.named_parameters() if "layers.0.mlp.experts." in n}
    results["num_params"] = policy.num_params
    lap("build")
    tensors["exported_bucketed"] = {n: t.cpu().clone() for n, t in policy.named_hf_weights_bucketed(bucket_mb=0.05)}
    tensors["exported_streamed"] = {n: t.cpu().clone() for n, t in policy.named_hf_weights()}
    lap("export")

    def logprobs(grad: bool):
        logp, _ = policy.forward_logprobs(row["input_ids"], row["position_ids"], row["labels"], grad=grad,
                                          select=row["select"], mm=row["mm"])
        return logp[0]

    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, logprobs(grad=False).cpu())
    tensors["logprobs"] = gathered
    results["replay"], replayed, native = replay_row(policy, row, info)
    tensors["replay_logprobs"] = [None] * info.world_size
    dist.all_gather_object(tensors["replay_logprobs"], replayed.cpu())
    results["replay"]["native_unchanged"] = bool(torch.equal(native.cpu(), tensors["logprobs"][info.rank]))
    lap("routing replay")
    logp = logprobs(grad=True)
    policy.backward(-(logp * torch.linspace(-1.0, 1.5, logp.shape[0])).sum())
    tensors["grads"] = {n: policy._whole(n, p.grad, None).cpu().clone() for n, p in policy.model.named_parameters()}
    results["step"] = policy.step()
    lap("forward, backward, step")
    policy.save_hf(os.path.join(out, "hf_step"))  # rank 0 writes; the rollout's reference below
    lap("save_hf")

    # --- the rollout: vLLM with images, before and after a push of the trained weights ---------
    from rlcore.rollout.checks import capture_load_weights, missing_params
    from rlcore.colocate_rollout import ColocateRollout

    ro = ColocateRollout(model_dir, info, tp_size=1, seed=0, kv_cache_gb=0.0625, max_model_len=256,
                         limit_mm_per_prompt=LIMITS)
    lap("rollout build")
    m: dict = {"rank": info.rank}
    prompts, images = rollout_inputs(info.rank)
    sample = dict(n=2, temperature=1.0, max_tokens=4, seed=7)
    first = ro.generate(prompts, images=images, **sample)
    m["n_per_prompt"] = [len(s) for s in first]
    before = Reference(model_dir)
    m["lp_diff_before"] = before.max_diff(prompts, images, first)
    lap("rollout generate + compare")
    model = ro._model_runner().get_model()
    # The MoE guard on the real engine (finding F6: vllm 0.32 has MoERunner layers, no FusedMoE class).
    from rlcore.rollout.checks import check_weight_load, has_fused_moe

    m["has_fused_moe"] = has_fused_moe(model)
    try:
        check_weight_load("direct", "cuda", ro._worker(), model)
        m["direct_refused"] = False
    except RuntimeError:
        m["direct_refused"] = True
    t0 = time.perf_counter()
    with capture_load_weights(model) as calls:
        m["pushed"] = ro.update_weights(policy.named_hf_weights_bucketed())
    m["update_s"] = round(time.perf_counter() - t0, 3)
    loaded = set().union(*[c for c in calls if c is not None]) if calls else set()
    m["vllm_params_missed"] = missing_params(model, loaded)
    after = ro.generate(prompts, images=images, **sample)
    trained = Reference(os.path.join(out, "hf_step"))
    m["lp_diff_after"] = trained.max_diff(prompts, images, after)
    m["lp_shift"] = trained.max_diff(prompts, images, first)  # the first samples under the new weights
    lap("push + generate + compare")
    ro.shutdown()
    m["ascend"] = ascend_sleep_cycle(model_dir, info, policy, prompts, images, sample, before, trained)
    lap("vllm-ascend emulation: sleep 2, wake, restore, push, generate")
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, m)
    results["rollout"] = gathered
    results["times_s"] = times
    if info.rank == 0:
        print(json.dumps(results, indent=1))
        torch.save(tensors, os.path.join(out, "tensors.pt"))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def ascend_sleep_cycle(model_dir, info, policy, prompts, images, sample, before, trained) -> dict:
    """rollout.emulate_ascend_moe on the VL-MoE engine: generate (the experts in the NPU kernel's
    layout), sleep level 2, wake the weights (vllm-ascend 0.23's swap, the rollout's restore), push
    the trained weights, wake the KV cache, generate; both against transformers."""
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.rollout import expert_layout

    restored = []
    restore = expert_layout.ExpertParams.restore
    expert_layout.ExpertParams.restore = lambda self: restored.append(restore(self)) or restored[-1]
    ro = ColocateRollout(model_dir, info, tp_size=1, seed=0, kv_cache_gb=0.0625, max_model_len=256,
                         limit_mm_per_prompt=LIMITS, emulate_sleep=True, sleep_level=2, emulate_ascend_moe=True)
    out = {"lp_diff_before": before.max_diff(prompts, images, ro.generate(prompts, images=images, **sample))}
    ro.release_memory()
    ro.resume_memory(["weights"])
    out["pushed"] = ro.update_weights(policy.named_hf_weights_bucketed())
    ro.resume_memory(["kv_cache"])
    out["lp_diff_after"] = trained.max_diff(prompts, images, ro.generate(prompts, images=images, **sample))
    out["restored"] = restored
    expert_layout.ExpertParams.restore = restore
    ro.shutdown()
    return out


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
