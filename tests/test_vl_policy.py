"""Vision-language policy (tiny Qwen3-VL and Qwen2.5-VL) through the real engine: VeOmni's patched
Qwen3-VL / Qwen2.5-VL, FSDP2 on gloo, 1 and 2 ranks.

This process never imports VeOmni (transformers stays unpatched): it builds the packed inputs
(processor output, transformers' own M-RoPE positions per sample, concatenated) and the
reference log-probs (transformers' ``Qwen3VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` on each sample alone); one torchrun launch per world size
(tests/workers/vl_policy.py) runs the engine on them, both models in turn (Qwen2.5-VL: the log-prob,
shared-prompt, text-only-row and export checks; the training/freeze/checkpoint/bf16 paths are
model-independent and run on Qwen3-VL only).

Packed row layout, as ``VeOmniPolicy.forward_logprobs`` takes it: ``position_ids`` (4, 1, L) =
[text positions restarting per sample; M-RoPE t; h; w of each sample], ``mm`` = the samples'
``pixel_values`` and ``image_grid_thw`` concatenated in order, ``select`` the positions that
predict response tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import rlcore  # noqa: F401  (torchvision shim before transformers' Qwen-VL processor)
from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "vl_policy.py")
TOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from rlcore.demo.vl import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


def image(seed: int, h: int, w: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


class Sample:
    """One prompt (text + images, through the processor and the chat template) + a response."""

    def __init__(self, processor, model, text: str, images: list, response: list[int]):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=False)
        enc = processor(text=[prompt], images=images, return_tensors="pt")
        self.prompt_len = enc["input_ids"].shape[1]
        self.response = response
        self.input_ids = torch.cat([enc["input_ids"], torch.tensor([response])], dim=1)  # (1, n)
        self.mm_token_type_ids = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, len(response), dtype=torch.long)],
                                           dim=1)
        self.images = images
        self.pixel_values, self.image_grid_thw = enc["pixel_values"], enc["image_grid_thw"]
        # transformers' own M-RoPE positions for prompt + response (3, 1, n)
        self.rope, _ = model.model.get_rope_index(self.input_ids, self.mm_token_type_ids,
                                                  image_grid_thw=self.image_grid_thw)

    def reference_logprobs(self, model) -> torch.Tensor:
        """transformers on this sample alone (positions from mm_token_type_ids, as in generation)."""
        logits = model(input_ids=self.input_ids, pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                       mm_token_type_ids=self.mm_token_type_ids).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        rows = torch.arange(self.prompt_len - 1, self.input_ids.shape[1] - 1)
        return logp[rows, torch.tensor(self.response)]


def pack(samples: list[Sample]) -> dict:
    """Each sample its own copy: text positions restart at 0, no mask needed."""
    ids, pos, sel, labels = [], [], [], []
    offset = 0
    for s in samples:
        n = s.input_ids.shape[1]
        ids.append(s.input_ids[0])
        pos.append(torch.cat([torch.arange(n)[None], s.rope[:, 0]], dim=0))  # (4, n)
        sel += range(offset + s.prompt_len - 1, offset + n - 1)
        labels += s.response
        offset += n
    return {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(pos, dim=1)[:, None],
            "select": torch.tensor(sel), "labels": torch.tensor([labels]), "attention_mask": None,
            "mm": {"pixel_values": torch.cat([s.pixel_values for s in samples]),
                   "image_grid_thw": torch.cat([s.image_grid_thw for s in samples])}}


def pack_shared(samples: list[Sample]) -> dict:
    """Samples with one prompt: the prompt once, then each response, whose text and M-RoPE
    positions continue the prompt's (as transformers computes them for prompt + response), under
    a block mask: a response sees the prompt and itself."""
    first, p = samples[0], samples[0].prompt_len
    ids, pos, seg, sel, labels = [first.input_ids[0, :p]], [torch.cat([torch.arange(p)[None], first.rope[:, 0, :p]])], \
        [torch.zeros(p, dtype=torch.long)], [], []
    offset = p
    for i, s in enumerate(samples):
        assert torch.equal(s.input_ids[0, :p], first.input_ids[0, :p])
        r = len(s.response)
        ids.append(s.input_ids[0, p:])
        pos.append(torch.cat([torch.arange(p, p + r)[None], s.rope[:, 0, p:]]))
        seg.append(torch.full((r,), i + 1))
        sel += [p - 1] + list(range(offset, offset + r - 1))
        labels += s.response
        offset += r
    seg = torch.cat(seg)
    q, k = torch.arange(len(seg))[:, None], torch.arange(len(seg))[None]
    mask = ((seg[None] == 0) | (seg[:, None] == seg[None])) & (k <= q)
    return {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(pos, dim=1)[:, None],
            "select": torch.tensor(sel), "labels": torch.tensor([labels]), "attention_mask": mask[None, None],
            "mm": {"pixel_values": first.pixel_values, "image_grid_thw": first.image_grid_thw}}


def _responses():
    from rlcore.demo.vl import VOCAB

    words = [VOCAB.index(w) for w in ("red", "circle", "one", "2", "blue", "square", "the", "7", "shape")]
    g = torch.Generator().manual_seed(0)
    return lambda n: [words[int(i)] for i in torch.randint(len(words), (n,), generator=g)]  # noqa: E731


def _text_only(model) -> tuple[dict, torch.Tensor]:
    """A row of two text sequences, no image, and transformers' log-probs of it."""
    row = {"input_ids": torch.tensor([[3, 20, 25, 26, 27, 3, 21, 28, 29]]),
           "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]]),
           "select": torch.tensor([2, 3, 6, 7]), "labels": torch.tensor([[26, 27, 28, 29]]),
           "attention_mask": None, "mm": None}
    with torch.no_grad():
        seqs = (([3, 20, 25, 26, 27], [2, 3], [26, 27]), ([3, 21, 28, 29], [1, 2], [28, 29]))  # ids, rows, targets
        ref = [torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)[rows, targets]
               for ids, rows, targets in seqs]
    return row, torch.cat(ref)


def _main_samples(processor, model, resp) -> tuple[list, list]:
    """A packed row of 3 samples (one with 2 images, images of different shapes) and 3 samples of
    one prompt (for the shared-prompt layout)."""
    img_a, img_b, img_c, img_d = image(0, 96, 96), image(1, 96, 96), image(2, 64, 128), image(3, 128, 64)
    samples = [Sample(processor, model, "what colour is the shape ?", [img_a], resp(5)),
               Sample(processor, model, "how many shapes are there ?", [img_b, img_c], resp(3)),
               Sample(processor, model, "which shape is larger ?", [img_d], resp(8))]
    shared = [Sample(processor, model, "what colour is the shape ?", [img_a], resp(n)) for n in (4, 6, 2)]
    return samples, shared


@pytest.fixture(scope="module")
def vl_inputs(tiny_vl, tmp_path_factory):
    """Packed rows and transformers' reference log-probs, saved for the worker."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_vl)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_vl, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    resp = _responses()
    samples, shared = _main_samples(processor, model, resp)
    changed_img = samples[0].images[0].copy()
    changed_img.putpixel((40, 50), (255, 255, 255))
    changed = [Sample(processor, model, "what colour is the shape ?", [changed_img], samples[0].response)] + samples[1:]
    text_row, text_ref = _text_only(model)
    data = {"packed": pack(samples), "unshared": pack(shared), "shared": pack_shared(shared),
            "changed": pack(changed), "text_only": text_row}
    with torch.no_grad():
        ref = {"text_only": text_ref,
               "packed": torch.cat([s.reference_logprobs(model) for s in samples]),
               "shared": torch.cat([s.reference_logprobs(model) for s in shared]),
               "changed": torch.cat([s.reference_logprobs(model) for s in changed])}
    path = str(tmp_path_factory.mktemp("vl_inputs") / "inputs.pt")
    torch.save(data, path)
    return path, ref, [len(s.response) for s in samples]


@pytest.fixture(scope="module")
def tiny_vl25_legacy(tmp_path_factory) -> str:
    """The same Qwen2.5-VL as ``tiny_vl25_model`` (same seed), saved in the released checkpoints'
    layout (``visual.*``, ``model.layers.*``)."""
    from rlcore.demo.vl import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl25_legacy")), family="qwen2_5_vl",
                              original_layout=True)


@pytest.fixture(scope="module")
def vl25_inputs(tiny_vl25_model, tmp_path_factory):
    """Qwen2.5-VL: the packed, shared-prompt and text-only rows and transformers' log-probs."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_vl25_model)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl25_model, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    samples, shared = _main_samples(processor, model, _responses())
    # 96x96 -> 84x84 (patch 14): 3x3 merged tokens in 2x2 ViT windows; 64x128 -> 56x140: 2x5
    assert [g.tolist() for s in samples for g in s.image_grid_thw] == [[1, 6, 6], [1, 6, 6], [1, 4, 10], [1, 10, 4]]
    text_row, text_ref = _text_only(model)
    data = {"packed": pack(samples), "unshared": pack(shared), "shared": pack_shared(shared), "text_only": text_row}
    with torch.no_grad():
        ref = {"text_only": text_ref,
               "packed": torch.cat([s.reference_logprobs(model) for s in samples]),
               "shared": torch.cat([s.reference_logprobs(model) for s in shared])}
    path = str(tmp_path_factory.mktemp("vl25_inputs") / "inputs.pt")
    torch.save(data, path)
    return path, ref


@pytest.fixture(scope="module")
def vl_run(tiny_vl, vl_inputs, tiny_vl25_model, vl25_inputs, tiny_vl25_legacy, tmp_path_factory):
    """One launch per world size runs both models: Qwen3-VL's full sequence, then Qwen2.5-VL's."""
    cache: dict[int, dict] = {}

    def get(nproc: int) -> dict:
        if nproc not in cache:
            out = tmp_path_factory.mktemp(f"vl_ws{nproc}")
            proc = run_torchrun(WORKER, nproc, tiny_vl, vl_inputs[0], str(out), tiny_vl25_model, vl25_inputs[0],
                                tiny_vl25_legacy)
            with open(out / "results.json") as f:
                results = json.load(f)
            cache[nproc] = {"out": str(out), "results": results, "stdout": proc.stdout,
                            "tensors": torch.load(out / "tensors.pt", weights_only=False)}
        return cache[nproc]

    return get


def maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("nproc", [1, 2])
def test_vl_logprobs_match_transformers(vl_run, vl_inputs, nproc):
    """Packed row of 3 samples (one with 2 images), response-only select: equal to transformers per
    sample; a shared-prompt row (block mask) equal to the unshared one, with the same gradient;
    eager attention too; one changed pixel changes its own sample only."""
    run, (_, ref, lengths) = vl_run(nproc), vl_inputs
    t, r = run["tensors"], run["results"]
    print(f"ws{nproc}: worker times {r['times_s']}")
    for name, other in (("packed", ref["packed"]), ("packed_eager", ref["packed"]), ("shared", ref["shared"]),
                        ("unshared", ref["shared"]), ("shared_eager", ref["shared"]), ("changed", ref["changed"]),
                        ("text_only", ref["text_only"]), ("packed_bf16", ref["packed"])):
        print(f"ws{nproc}: max |{name} - transformers| = {maxdiff(t[name], other):.2e}")
    print(f"ws{nproc}: grad rel diff shared vs unshared {r['grad_rel_diff_shared_vs_unshared']:.2e}, "
          f"pixel change moves sample 0 by {maxdiff(t['changed'][:lengths[0]], t['packed'][:lengths[0]]):.2e}")
    assert maxdiff(t["packed"], ref["packed"]) <= TOL
    assert maxdiff(t["packed_eager"], ref["packed"]) <= TOL
    assert maxdiff(t["shared"], ref["shared"]) <= TOL and maxdiff(t["unshared"], ref["shared"]) <= TOL
    assert maxdiff(t["shared"], t["unshared"]) <= TOL
    assert maxdiff(t["shared_eager"], ref["shared"]) <= TOL
    assert r["grad_rel_diff_shared_vs_unshared"] < 1e-5 and r["grad_norm_unshared"] > 0
    assert r["visual_grad_norm"] > 0  # the loss reaches the vision tower
    # one pixel of sample 0's image: its log-probs move, the other packed samples' do not
    a = lengths[0]
    assert maxdiff(t["changed"], ref["changed"]) <= TOL
    assert maxdiff(t["changed"][:a], t["packed"][:a]) > 10 * TOL
    assert maxdiff(t["changed"][a:], t["packed"][a:]) <= TOL
    # bf16 compute runs (forward, backward, step) and stays near fp32
    assert r["bf16_step_finite"] and maxdiff(t["packed_bf16"], ref["packed"]) < 0.1
    # a text-only row through the VL model (on 2 ranks: rank 1's row while rank 0's has images)
    assert maxdiff(t["text_only"], ref["text_only"]) <= TOL
    assert r["input_errors"] == ["(3, 1, L) positions", "(1, L) positions with images", "an image missing",
                                 "image tokens without mm", "an unknown mm key",
                                 "text row with (4, 1, L) positions runs"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_vl_freeze_vision_tower_export_and_checkpoint(vl_run, tiny_vl, nproc):
    """Export (streamed, bucketed, save_hf) = the checkpoint's names and values; one step with
    freeze_vision_tower leaves model.visual.* bit-identical and moves the rest, without it
    everything moves; DCP save/load of the frozen engine resumes bit-identically."""
    from safetensors.torch import load_file

    run = vl_run(nproc)
    r, t = run["results"], run["tensors"]
    ckpt = load_file(os.path.join(tiny_vl, "model.safetensors"))
    exported = t["exported"]
    assert set(exported) == set(ckpt) and all(torch.equal(exported[n], ckpt[n]) for n in ckpt)
    assert r["bucketed_equals_export"]
    saved = load_file(os.path.join(run["out"], "hf", "model.safetensors"))  # save_hf, before any step
    assert set(saved) == set(ckpt) and all(torch.equal(saved[n], ckpt[n]) for n in ckpt)
    visual = [n for n in ckpt if n.startswith("model.visual.")]
    assert visual and len(visual) < len(ckpt)
    frozen, trained = t["after_frozen"], t["after_trained"]
    # frozen: the tower bit-identical, every text tensor moved, no optimizer state for the tower
    assert all(torch.equal(frozen[n], ckpt[n]) for n in visual)
    assert all(not torch.equal(frozen[n], ckpt[n]) for n in ckpt if n not in visual)
    assert r["frozen_optimizer_params"] == r["frozen_optimizer_state"] == len(ckpt) - len(visual)
    assert r["trained_optimizer_params"] == len(ckpt)
    # trained: the tower moves too (every tensor of it)
    assert all(not torch.equal(trained[n], ckpt[n]) for n in ckpt)
    assert "vision tower frozen" in r["describe_frozen"] and "vision tower trained" in r["describe_trained"]
    # DCP save after the frozen step, load into a fresh frozen engine: same weights, same next step
    assert r["resume_weights_equal"] and r["resume_next_step_equal"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_vl25_logprobs_and_export(vl_run, vl25_inputs, tiny_vl25_model, nproc):
    """Qwen2.5-VL (window-attention ViT, patch 14, M-RoPE sections [4, 6, 6]): the packed row of 3
    samples (one with 2 images) and the shared-prompt row equal transformers per sample, shared
    equals unshared with the same gradient, a text-only row (on 2 ranks next to rank 0's image row:
    VeOmni's dummy ViT forward) too; export = the checkpoint's names and values. A folder in the
    released checkpoints' layout (``visual.*``, ``model.layers.*``) loads the same weights once
    ``engine_vl.apply_checkpoint_key_mapping`` runs before VeOmni's weight load."""
    from safetensors.torch import load_file

    run, (_, ref) = vl_run(nproc), vl25_inputs
    t, r = run["tensors"], run["results"]
    for name, other in (("packed", ref["packed"]), ("shared", ref["shared"]), ("unshared", ref["shared"]),
                        ("text_only", ref["text_only"]), ("legacy_packed", ref["packed"])):
        print(f"ws{nproc}: qwen2.5-vl max |{name} - transformers| = {maxdiff(t['q25_' + name], other):.2e}")
    print(f"ws{nproc}: qwen2.5-vl grad rel diff shared vs unshared {r['q25_grad_rel_diff_shared_vs_unshared']:.2e}, "
          f"times {r['q25_times_s']}")
    assert maxdiff(t["q25_packed"], ref["packed"]) <= TOL
    assert maxdiff(t["q25_shared"], ref["shared"]) <= TOL and maxdiff(t["q25_unshared"], ref["shared"]) <= TOL
    assert maxdiff(t["q25_shared"], t["q25_unshared"]) <= TOL
    assert r["q25_grad_rel_diff_shared_vs_unshared"] < 1e-5 and r["q25_grad_norm_unshared"] > 0
    assert r["q25_visual_grad_norm"] > 0
    assert maxdiff(t["q25_text_only"], ref["text_only"]) <= TOL
    assert r["q25_input_errors"] == r["input_errors"]  # the same refusals as Qwen3-VL
    assert "vision tower trained" in r["q25_describe"]
    ckpt = load_file(os.path.join(tiny_vl25_model, "model.safetensors"))
    exported = t["q25_exported"]
    assert set(exported) == set(ckpt) and all(torch.equal(exported[n], ckpt[n]) for n in ckpt)
    assert any(n.startswith("model.visual.") for n in ckpt) and any(n.startswith("model.language_model.") for n in ckpt)
    # the released layout: mapped onto the same module names, bit-identical weights, same log-probs
    assert r["q25_legacy_mapping_set"]
    legacy = t["q25_legacy_exported"]
    assert set(legacy) == set(ckpt) and all(torch.equal(legacy[n], ckpt[n]) for n in ckpt)
    assert maxdiff(t["q25_legacy_packed"], ref["packed"]) <= TOL
