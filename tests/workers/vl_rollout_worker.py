"""torchrun worker for tests/test_vl_rollout.py: ColocateRollout with image prompts on a tiny
Qwen3-VL (and, when given, a tiny Qwen2.5-VL after it in the same launch), against transformers'
forward of the same model (fp32).

usage: vl_rollout_worker.py MODEL_DIR OUT_JSON TP_SIZES [QWEN25_DIR]    (TP_SIZES: e.g. 1,2)

Every rank measures; rank 0 writes all ranks' measurements to OUT_JSON (one entry per TP size,
run one after the other in this launch) and the pytest side asserts on them. Order: build (cold model-info cache), sample and compare (1- and 2-image prompts
and a text prompt in one call), placeholder expansion, a one-pixel change, a push of perturbed
vision weights, a push of the original weights, a reload from the folder, a release/resume,
the refusals, shutdown. Qwen2.5-VL then gets a fresh engine in the same process: sample and
compare, expansion, the vision-weight push and the push back (the other checks do not depend on
the model family), shutdown.
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys
import time

import rlcore  # noqa: F401  (first: the torchvision shim, before transformers/vLLM import it)
import torch
import torch.distributed as dist

from rlcore.demo.vl import COLOURS, VOCAB
from rlcore.dist import init_distributed
from rlcore.rollout.checks import capture_load_weights, missing_params
from rlcore.colocate_rollout import ColocateRollout

T = 1.0
N = 2
MAX_TOKENS = 4
SEED = 7
LIMITS = {"image": 2, "video": 0}
QUESTION = "<|im_start|> user {images} what colour is the shape ? <|im_end|> <|im_start|> assistant"
IMAGE = "<|vision_start|> <|image_pad|> <|vision_end|>"
MODELINFO = "modelinfos/vllm-model_executor-models-qwen3_vl-Qwen3VLForConditionalGeneration.json"
MODELINFO25 = "modelinfos/vllm-model_executor-models-qwen2_5_vl-Qwen2_5_VLForConditionalGeneration.json"


# ----------------------------------------------------------------------------- inputs


def image(colour: str, box: tuple[int, int, int, int], size: int = 96):
    """A white ``size`` x ``size`` RGB image with one filled rectangle (96 x 96 = 9 image tokens)."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size, size), (255, 255, 255))
    ImageDraw.Draw(im).rectangle(box, fill=COLOURS[colour])
    return im


def prompt(num_images: int) -> list[int]:
    ids = {w: i for i, w in enumerate(VOCAB)}
    return [ids[w] for w in QUESTION.format(images=" ".join([IMAGE] * num_images)).split()]


def inputs(rank: int) -> tuple[list[list[int]], list]:
    """Two 1-image prompts, a 2-image prompt and a text prompt; the shapes move with the rank, so
    data-parallel engines get different images."""
    o = 5 * rank
    images = [[image("red", (10 + o, 10, 60 + o, 50))],
              [image("blue", (30, 20 + o, 90, 70 + o))],
              [image("green", (5, 5 + o, 40, 40 + o)), image("yellow", (50 + o, 40, 90, 90))],
              None]
    return [prompt(1), prompt(1), prompt(2), prompt(0)], images


# ----------------------------------------------------------------------------- the reference


class Reference:
    """transformers' Qwen3-VL / Qwen2.5-VL in fp32 and the model folder's image processor: the
    trainer side."""

    def __init__(self, model_dir: str):
        from transformers import AutoConfig, AutoProcessor, Qwen2_5_VLForConditionalGeneration, \
            Qwen3VLForConditionalGeneration

        model_cls = {"qwen3_vl": Qwen3VLForConditionalGeneration,
                     "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[AutoConfig.from_pretrained(model_dir).model_type]
        self.model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.image_processor = AutoProcessor.from_pretrained(model_dir).image_processor
        self.image_token = int(self.model.config.image_token_id)
        self.merge = int(self.model.config.vision_config.spatial_merge_size)

    def expand(self, ids: list[int], images: list | None) -> tuple[list[int], dict]:
        """(expanded ids, processor outputs): each image token repeated
        ``image_grid_thw.prod() // merge_size**2`` times, the trainer's expansion. Written here, not
        taken from rlcore.task.images, so that the comparison with vLLM's ids stays independent."""
        if not images:
            return list(ids), {}
        out = self.image_processor(images=images, return_tensors="pt")
        counts = (out["image_grid_thw"].prod(-1) // self.merge**2).tolist()
        expanded, k = [], 0
        for t in ids:
            if t == self.image_token:
                expanded += [t] * counts[k]
                k += 1
            else:
                expanded.append(t)
        return expanded, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    @torch.no_grad()
    def logprobs(self, ids: list[int], images: list | None, response: list[int], temperature: float) -> torch.Tensor:
        """[len(response)] log_softmax(logits / T) at the response tokens.

        Prompt (with its images) first, then the response through the KV cache: to vLLM every
        response token is text, also an ``<|image_pad|>`` the random model sampled, while one
        forward over prompt + response would take that token for an image slot (transformers
        places image features at every ``input_ids == image_token_id``)."""
        self.model.model.rope_deltas = None  # M-RoPE offset of the previous prompt (transformers caches it)
        expanded, vision = self.expand(ids, images)
        x = torch.tensor([expanded])
        if vision:  # transformers 5 needs the token types to build M-RoPE positions
            vision["mm_token_type_ids"] = (x == self.image_token).int()
        out = self.model(input_ids=x, use_cache=True, **vision)
        logits = [out.logits[0, -1:]]
        if len(response) > 1:  # positions continue from the prompt's (cached M-RoPE offset)
            logits.append(self.model(input_ids=torch.tensor([response[:-1]]), past_key_values=out.past_key_values,
                                     use_cache=True).logits[0])
        lp = torch.log_softmax(torch.cat(logits).float() / temperature, dim=-1)
        return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]

    def max_diff(self, prompts, images, samples, temperature: float = T, only: list[int] | None = None) -> float:
        """Max |vLLM logprob - transformers logprob| over every sampled token (of prompts ``only``)."""
        worst = 0.0
        for j, (ids, imgs, per_prompt) in enumerate(zip(prompts, images, samples)):
            if only is not None and j not in only:
                continue
            for s in per_prompt:
                ref = self.logprobs(ids, imgs, s.response_ids, temperature)
                worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
        return worst


def perturb_visual_(model, seed: int = 5, scale: float = 0.05) -> list[str]:
    """Fixed-seed noise on every ``model.visual.*`` tensor (patch embedding, blocks, mergers);
    the language model is left alone. Returns the names changed."""
    gen = torch.Generator().manual_seed(seed)
    names = []
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.startswith("model.visual."):
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
                names.append(name)
    return names


def as_plain(samples) -> list:
    return [[(s.response_ids, s.logprobs, s.finish_reason) for s in per] for per in samples]


# ----------------------------------------------------------------------------- checks


def spy_prompt_ids(ro) -> list:
    """Record vLLM's ``RequestOutput.prompt_token_ids`` of every generate call the rollout makes."""
    seen: list = []
    original = ro.llm.generate

    def spy(*args, **kwargs):
        outputs = original(*args, **kwargs)
        seen.append([list(o.prompt_token_ids) for o in outputs])
        return outputs

    ro.llm.generate = spy
    return seen


def sampling_checks(ro, ref, model_dir: str, prompts, images, seen, m: dict) -> list:
    t0 = time.perf_counter()
    first = ro.generate(prompts, images=images, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=SEED)
    m["first_generate_s"] = time.perf_counter() - t0
    m["n_per_prompt"] = [len(s) for s in first]
    m["lp_diff"] = ref.max_diff(prompts, images, first)
    m["lp_diff_two_images"] = ref.max_diff(prompts, images, first, only=[2])
    m["lp_diff_text"] = ref.max_diff(prompts, images, first, only=[3])
    # The random model samples any token, <|image_pad|> too (text to vLLM, see Reference.logprobs).
    m["image_tokens_sampled"] = sum(s.response_ids.count(ref.image_token) for per in first for s in per)
    # Placeholder expansion: vLLM's prompt_token_ids against the trainer's expansion.
    vllm_ids = seen[-1]
    mine = [ref.expand(p, imgs)[0] for p, imgs in zip(prompts, images)]
    m["vllm_prompt_lens"] = [len(ids) for ids in vllm_ids]
    m["sent_prompt_lens"] = [len(p) for p in prompts]
    m["image_tokens"] = [sum(t == ref.image_token for t in ids) for ids in vllm_ids]
    m["expansion_equal"] = vllm_ids == mine
    try:  # the trainer's own helper, when it is there
        from rlcore.task.images import VisionProcessor

        vp = VisionProcessor(model_dir)
        theirs = [vp.prepare(p, imgs)[0] if imgs else list(p) for p, imgs in zip(prompts, images)]
        m["rlcore_vision_expansion_equal"] = vllm_ids == theirs
    except (ImportError, AttributeError, TypeError) as e:
        m["rlcore_vision_expansion_equal"] = f"not checked: {type(e).__name__}: {e}"
    return first


def pixel_checks(ro, ref, prompts, images, first, m: dict) -> None:
    """One pixel of the first image changed: vLLM follows the new pixels, not the old ones."""
    changed = images[0][0].copy()
    changed.putpixel((80, 80), (0, 0, 0))  # white -> black, outside the rectangle
    out = ro.generate(prompts[:1], images=[[changed]], n=N, temperature=T, max_tokens=MAX_TOKENS, seed=SEED)
    m["pixel_lp_diff"] = ref.max_diff(prompts[:1], [[changed]], out)
    # The new samples scored with the old image by transformers, and by vLLM itself where it
    # sampled the same tokens as with the old image (same seed).
    m["pixel_shift_hf"] = ref.max_diff(prompts[:1], [images[0]], out)
    same = [(a, b) for a, b in zip(first[0], out[0]) if a.response_ids == b.response_ids]
    m["pixel_same_tokens"] = len(same)
    m["pixel_shift_vllm"] = max((max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) for a, b in same),
                                default=None)


def vision_sync_checks(ro, ref, prompts, images, first, m: dict) -> None:
    """Push perturbed vision weights (every HF tensor), then the original ones again."""
    original = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    m["perturbed"] = len(perturb_visual_(ref.model))
    model = ro._model_runner().get_model()
    t0 = time.perf_counter()
    with capture_load_weights(model) as calls:
        m["pushed"] = ro.update_weights((name, p.data) for name, p in ref.model.named_parameters())
    m["update_s"] = time.perf_counter() - t0
    # Every vLLM parameter written by the HF-named full set (names accepted by vLLM's mapper).
    loaded = set().union(*[c for c in calls if c is not None]) if calls else set()
    m["vllm_params_missed"] = missing_params(model, loaded)
    m["vllm_params"] = len(list(model.named_parameters()))
    m["pushed_visual_names"] = sum(n.startswith("model.visual.") for n, _ in ref.model.named_parameters())
    after = ro.generate(prompts, images=images, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=SEED)
    m["lp_diff_vision_updated"] = ref.max_diff(prompts, images, after)
    # The first samples scored by the perturbed model: how far the push moved the logprobs.
    m["lp_shift_vision"] = ref.max_diff(prompts, images, first, only=[0, 1, 2])
    # The text prompt does not see the vision tower: same seed, same samples.
    m["text_prompt_unchanged"] = as_plain(after[3:]) == as_plain(first[3:])
    ref.model.load_state_dict(original)
    ro.update_weights((name, p.data) for name, p in ref.model.named_parameters())
    back = ro.generate(prompts, images=images, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=SEED)
    m["lp_diff_restored"] = ref.max_diff(prompts, images, back)
    m["restored_equals_first"] = as_plain(back) == as_plain(first)


def reset_path_checks(ro, model_dir, prompts, images, first, m: dict) -> None:
    """The other ways vLLM's cached image encodings must go: a reload from the model folder after
    a push of other vision weights, and a release/resume of the engine's memory."""
    noisy = {name: t.clone() for name, t in _hf_tensors(model_dir).items()}
    gen = torch.Generator().manual_seed(11)
    for name, t in noisy.items():
        if name.startswith("model.visual."):
            t.add_(torch.randn(t.shape, generator=gen) * 0.05)
    ro.update_weights(noisy.items())
    moved = ro.generate(prompts, images=images, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=SEED)
    m["moved_before_path_reload"] = as_plain(moved[:3]) != as_plain(first[:3])
    ro.update_weights_from_path(model_dir)
    again = ro.generate(prompts, images=images, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=SEED)
    m["path_reload_equals_first"] = as_plain(again) == as_plain(first)
    ro.release_memory()
    ro.resume_memory()
    again = ro.generate(prompts, images=images, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=SEED)
    m["release_resume_equals_first"] = as_plain(again) == as_plain(first)


def _hf_tensors(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def refusal_checks(ro, prompts, images, m: dict) -> None:
    """A prompt over limit_mm_per_prompt is refused by vLLM; a wrong placeholder count by us."""
    three = [images[2] + images[0]]
    try:
        ro.generate([prompt(3)], images=three, n=1, max_tokens=1, seed=SEED)
        m["over_limit"] = "returned"
    except Exception as e:  # noqa: BLE001 (which error vLLM raises is what is recorded)
        m["over_limit"] = f"{type(e).__name__}: {e}"[:300]
    try:
        ro.generate([prompts[0]], images=[images[2]], n=1, max_tokens=1, seed=SEED)
        m["wrong_placeholders"] = "returned"
    except ValueError as e:
        m["wrong_placeholders"] = f"ValueError: {e}"
    # Still serving after the refusals.
    m["after_refusals"] = len(ro.generate(prompts[:1], images=images[:1], n=1, max_tokens=1, seed=SEED)[0])


def qwen25_checks(model_dir: str, info, tp: int) -> dict:
    """A fresh engine on the Qwen2.5-VL folder (the released checkpoints' layout: ``visual.*``,
    ``model.layers.*``): sampled log-probs against transformers, the placeholder expansion, then
    perturbed vision weights pushed under the module names the policy exports (``model.visual.*``,
    ``model.language_model.*``), and the originals pushed back."""
    cache_root = os.environ.get("VLLM_CACHE_ROOT")
    m: dict = {"modelinfo_cached_before": bool(cache_root) and os.path.exists(os.path.join(cache_root, MODELINFO25))}
    dist.barrier()  # every rank looked before any rank builds
    t0 = time.perf_counter()
    ref = Reference(model_dir)
    ro = ColocateRollout(model_dir, info, tp_size=tp, seed=0, kv_cache_gb=0.0625, max_model_len=256,
                         limit_mm_per_prompt=LIMITS)
    m["init_s"] = time.perf_counter() - t0
    m["modelinfo_cached_after"] = bool(cache_root) and os.path.exists(os.path.join(cache_root, MODELINFO25))
    m["model_type"] = ro.llm.llm_engine.vllm_config.model_config.hf_config.model_type
    m["image_token_id"] = ro.image_token_id
    seen = spy_prompt_ids(ro)
    prompts, images = inputs(info.rank // tp)
    first = sampling_checks(ro, ref, model_dir, prompts, images, seen, m)
    vision_sync_checks(ro, ref, prompts, images, first, m)
    m["pushed_names"] = sorted({n.split(".")[0] + "." + n.split(".")[1] for n, _ in ref.model.named_parameters()})
    m["samples"] = as_plain(first)
    ro.shutdown()
    m["total_s"] = time.perf_counter() - t0
    return m


def layout_checks(model_dir: str, info, tp: int, qwen25_dir: str | None) -> dict:
    """Every check on one engine layout (``tp`` of this launch's ranks per engine), then the same
    on Qwen2.5-VL when given; engines shut down after."""
    m: dict = {"rank": info.rank}
    cache_root = os.environ.get("VLLM_CACHE_ROOT")
    m["modelinfo_cached_before"] = bool(cache_root) and os.path.exists(os.path.join(cache_root, MODELINFO))
    dist.barrier()  # every rank looked before any rank builds (and writes the cache)
    t0 = time.perf_counter()
    ref = Reference(model_dir)
    m["hf_load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ro = ColocateRollout(model_dir, info, tp_size=tp, seed=0, kv_cache_gb=0.0625, max_model_len=256,
                         limit_mm_per_prompt=LIMITS)
    m["init_s"] = time.perf_counter() - t0
    m["modelinfo_cached_after"] = bool(cache_root) and os.path.exists(os.path.join(cache_root, MODELINFO))
    mm = ro.llm.llm_engine.vllm_config.model_config.multimodal_config
    m["engine"] = {"multimodal": ro.multimodal, "image_token_id": ro.image_token_id,
                   "mm_processor_cache_gb": mm.mm_processor_cache_gb,
                   "limits": {k: mm.get_limit_per_prompt(k) for k in ("image", "video")},
                   "tp": ro.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
                   "dp_rank": ro.dp_rank, "describe": ro.describe()}
    seen = spy_prompt_ids(ro)
    prompts, images = inputs(info.rank // tp)
    first = sampling_checks(ro, ref, model_dir, prompts, images, seen, m)
    pixel_checks(ro, ref, prompts, images, first, m)
    vision_sync_checks(ro, ref, prompts, images, first, m)
    reset_path_checks(ro, model_dir, prompts, images, first, m)
    refusal_checks(ro, prompts, images, m)
    m["samples"] = as_plain(first)
    ro.shutdown()
    if qwen25_dir:
        m["qwen25"] = qwen25_checks(qwen25_dir, info, tp)
    return m


def main() -> None:
    model_dir, out_json, tps = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    qwen25_dir = sys.argv[4] if len(sys.argv) > 4 else None
    info = init_distributed("cpu")
    torch._C.set_num_threads(1)
    layouts = []
    for tp in tps:  # one engine layout after the other in this process, each torn down before the next
        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, layout_checks(model_dir, info, tp, qwen25_dir))
        layouts.append({"world_size": info.world_size, "tp": tp, "ranks": gathered})
    if info.rank == 0:
        with open(out_json, "w") as f:
            json.dump(layouts, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
