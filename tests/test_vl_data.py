"""Image prompts without any engine: the torchvision shim, the processor-side expansion and M-RoPE
positions against transformers' own, data rows with images (JSONL paths, Parquet bytes, bad rows),
packing of image prompts, the shapes task and the geo3k converter."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO



def test_torchvision_imports_on_this_cpu_host_through_the_shim():
    """Fresh interpreters of the venv. Without the shim `import torchvision` fails on this host (the
    public wheel's ops link CUDA); with it (the venv's import hook from scripts/setup_env.sh, or
    `import rlcore` first) vLLM and the transforms the Qwen-VL processors use import."""
    env = {**os.environ, "PYTHONPATH": REPO}
    drop_hook = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_TorchvisionHook']; "

    def run(code):
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    has_ops = run("import torchvision.extension as e; print(e._has_ops())")
    assert has_ops.returncode == 0, has_ops.stderr[-2000:]  # through the venv's hook
    via_vllm = run("from vllm import LLM; import torch, torchvision.transforms.v2.functional as F; "
                   "print(F.resize(torch.ones(3, 4, 4), [2, 2]).shape)")
    assert via_vllm.returncode == 0 and "[3, 2, 2]" in via_vllm.stdout, via_vllm.stderr[-2000:]
    via_rlcore = run(drop_hook + "import rlcore, torchvision.transforms.v2")
    assert via_rlcore.returncode == 0, via_rlcore.stderr[-2000:]
    bare = run(drop_hook + "import torchvision")
    if has_ops.stdout.strip() == "False":  # this CPU host: the ops do not load, the shim is what works
        assert bare.returncode != 0 and "torchvision::nms does not exist" in bare.stderr
    else:  # a torchvision whose ops load: nothing to fix, the shim stays out
        assert bare.returncode == 0


def _images():
    from PIL import Image

    return [Image.new("RGB", (96, 64), (200, 10, 10)), Image.new("RGB", (40, 130), (10, 200, 10))]


def _two_image_ids(tokenizer):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many shapes ?"},
                                         {"type": "image"}]}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_expansion_pixels_and_mrope_positions_equal_transformers(family, request):
    """Independent computation: the HF processor's expanded ids and pixel values, and
    ``Qwen3VLModel.get_rope_index`` / ``Qwen2_5_VLModel.get_rope_index`` (transformers 5.19) for
    the positions, on a two-image prompt (images with h != w merged patches)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from rlcore.task.images import VisionProcessor

    model_dir = request.getfixturevalue({"qwen3_vl": "tiny_vl_model", "qwen2_5_vl": "tiny_vl25_model"}[family])
    model_cls = {"qwen3_vl": Qwen3VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[family]
    vp = VisionProcessor(model_dir)
    assert vp.patch == {"qwen3_vl": 16, "qwen2_5_vl": 14}[family] and vp.merge == 2
    text, ids = _two_image_ids(vp.processor.tokenizer)
    images = _images()
    expanded, inputs = vp.prepare(ids, images)
    ref = vp.processor(text=[text], images=images, return_tensors="pt")
    assert ref["input_ids"][0].tolist() == expanded
    assert torch.equal(ref["pixel_values"], inputs.pixel_values)
    assert torch.equal(ref["image_grid_thw"], inputs.image_grid_thw)
    assert [vp.num_tokens(im) for im in images] == (inputs.image_grid_thw.prod(-1) // 4).tolist()
    grids = inputs.image_grid_thw[:, 1:] // 2
    assert (grids[:, 0] != grids[:, 1]).all()  # the text after an image advances by max(h, w)
    model = model_cls.from_pretrained(model_dir)
    assert model.config.model_type == family
    positions, _ = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref["image_grid_thw"])
    assert torch.equal(positions[:, 0], inputs.positions)
    assert inputs.next_position == int(positions.max()) + 1
    # a response continues at next_position on all three rows: what get_rope_index gives it too
    with_response = torch.cat([ref["input_ids"], torch.tensor([[30, 31]])], dim=1)
    types = torch.cat([ref["mm_token_type_ids"], torch.zeros(1, 2, dtype=ref["mm_token_type_ids"].dtype)], dim=1)
    full, _ = model.model.get_rope_index(with_response, types, ref["image_grid_thw"])
    assert full[:, 0, -2:].tolist() == [[inputs.next_position, inputs.next_position + 1]] * 3
    with pytest.raises(ValueError, match="2 image tokens for 1 images"):
        vp.prepare(ids, images[:1])


def _write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _vl_data_cfg(**kw):
    from rlcore.config import DataConfig

    return DataConfig(**{"image_key": "images", "apply_chat_template": True, "max_prompt_length": 64, **kw})


@pytest.mark.unit
def test_image_rows_load_from_jsonl_paths_and_parquet_bytes(tiny_vl_model, tmp_path):
    from rlcore.demo.vl import make_shapes_data
    from rlcore.run.preflight import load_tokenizer
    from rlcore.task.images import VisionProcessor, decode_image
    from rlcore.task.prompts import load_prompts

    tok, vp = load_tokenizer(tiny_vl_model), VisionProcessor(tiny_vl_model)
    jsonl, _ = make_shapes_data(str(tmp_path / "j"), n_train=6, n_val=1)
    parquet, _ = make_shapes_data(str(tmp_path / "p"), n_train=6, n_val=1, parquet=True)
    a, stats = load_prompts([jsonl], _vl_data_cfg(), tok, vp)
    b, _ = load_prompts([parquet], _vl_data_cfg(), tok, vp)
    assert stats["data/prompts"] == 6 and [p.ids for p in a] == [p.ids for p in b]  # same seed, same rows
    image_id = vp.image_token_id
    for p in a:
        assert p.ids.count(image_id) == 1 and len(p.images) == 1  # one placeholder token: vLLM expands it
        assert "<|vision_start|><|image_pad|><|vision_end|>" in p.text
    pixels = lambda ps: [decode_image(p.images[0]).tobytes() for p in ps]  # noqa: E731
    assert pixels(a) == pixels(b)
    # max_prompt_length counts the expanded image tokens (9 for a 96x96 image)
    longest = max(len(p.ids) for p in a) + 8
    assert len(load_prompts([jsonl], _vl_data_cfg(max_prompt_length=longest), tok, vp)[0]) == 6
    from rlcore.config import ConfigError

    shorter = sum(len(p.ids) + 8 < longest for p in a)
    try:
        kept, stats = load_prompts([jsonl], _vl_data_cfg(max_prompt_length=longest - 1), tok, vp)
        assert len(kept) == shorter and stats["data/filtered_too_long"] == 6 - shorter
    except ConfigError:
        assert shorter == 0


@pytest.mark.unit
@pytest.mark.parametrize("case,row,expected", [
    ("missing_file", {"prompt": "<image> q", "images": ["nope.png"], "answer": "1"}, "nope.png does not exist"),
    ("undecodable", {"prompt": "<image> q", "images": ["garbage.png"], "answer": "1"}, "cannot be decoded"),
    ("too_few_placeholders", {"prompt": "q", "images": ["ok.png"], "answer": "1"},
     "has 1 image(s) under 'images' but 0 '<image>' placeholder(s)"),
    ("too_many_placeholders", {"prompt": "<image> <image> q", "images": ["ok.png"], "answer": "1"},
     "but 2 '<image>' placeholder(s)"),
    ("not_an_image_entry", {"prompt": "<image> q", "images": [5], "answer": "1"}, "an image entry of type int"),
])
def test_bad_image_rows_name_file_and_line(tiny_vl_model, tmp_path, case, row, expected):
    from PIL import Image

    from rlcore.config import ConfigError
    from rlcore.run.preflight import load_tokenizer
    from rlcore.task.images import VisionProcessor
    from rlcore.task.prompts import load_prompts

    Image.new("RGB", (32, 32)).save(tmp_path / "ok.png")
    (tmp_path / "garbage.png").write_bytes(b"\x89PNG not really")
    good = {"prompt": "<image> how many shapes ?", "images": ["ok.png"], "answer": "1"}
    path = _write_rows(tmp_path / "rows.jsonl", [good, good, row, good])
    tok, vp = load_tokenizer(tiny_vl_model), VisionProcessor(tiny_vl_model)
    with pytest.raises(ConfigError) as err:
        load_prompts([path], _vl_data_cfg(), tok, vp)
    assert f"{path}:3 " in str(err.value) and expected in str(err.value), str(err.value)
    assert "data.skip_bad_rows=true" in str(err.value)
    prompts, stats = load_prompts([path], _vl_data_cfg(skip_bad_rows=True), tok, vp)
    assert len(prompts) == 3 and stats["data/bad_rows"] == 1


def _vision_inputs(n_tokens: int, tag: float, next_position: int):
    from rlcore.task.images import VisionInputs

    return VisionInputs(pixel_values=torch.full((4 * n_tokens, 6), tag), image_grid_thw=torch.tensor([[1, 2, 2 * n_tokens]]),
                        positions=torch.arange(3 * (n_tokens + 2)).view(3, -1), next_position=next_position)


@pytest.mark.unit
def test_pack_with_images_lays_out_positions_pixels_and_runs():
    """Unshared: every sample carries its prompt's pixels and M-RoPE block, text row restarting at 0.
    Shared: a run's images once. Equal ids with different images are different runs."""
    from rlcore.algo.batch import prompt_runs
    from rlcore.algo.packing import pack

    a, b = _vision_inputs(1, 1.0, 50), _vision_inputs(1, 2.0, 60)
    prompt = [7, 5, 6]  # expanded: one image token between start and end
    prompts, responses, vision = [prompt] * 4, [[30], [31, 32], [33], [34, 35]], [a, a, b, b]
    assert prompt_runs(prompts) == [(0, 4)] and prompt_runs(prompts, vision) == [(0, 2), (2, 4)]
    flat = pack(prompts, responses, "cpu", vision=vision)
    pos = flat["position_ids"]  # (4, 1, L)
    assert pos.shape == (4, 1, 3 * 4 + 6)
    assert pos[0, 0, :4].tolist() == [0, 1, 2, 3] and pos[0, 0, 4:9].tolist() == [0, 1, 2, 3, 4]
    assert pos[1:, 0, :3].tolist() == a.positions.tolist() and pos[1:, 0, 3].tolist() == [50, 50, 50]
    assert pos[1:, 0, 7:9].tolist() == [[50, 51]] * 3
    assert flat["mm"]["pixel_values"].shape == (16, 6) and flat["mm"]["image_grid_thw"].shape == (4, 3)
    assert flat["mm"]["pixel_values"][:, 0].tolist() == [1.0] * 8 + [2.0] * 8  # per prompt copy, in order
    assert flat["attention_mask"] is None  # packed blocks come from the text row
    shared = pack(prompts, responses, "cpu", vision=vision, share_prompt=True)
    assert shared["mm"]["image_grid_thw"].shape == (2, 3)  # each run's image once
    assert shared["position_ids"][1:, 0, 3:6].tolist() == [[50, 50, 51]] * 3  # r1 at 50; r2 starts at 50 again
    assert shared["position_ids"][0, 0, :6].tolist() == [0, 1, 2, 3, 3, 4]
    assert shared["attention_mask"].shape == (1, 1, 12, 12)
    assert torch.equal(flat["labels"], shared["labels"])
    # a response's last token is a label only: image rows never feed it (it may be a vision slot token)
    assert flat["input_ids"][0, 3].item() == prompt[-1] and flat["labels"][0, 0].item() == 30
    assert flat["input_ids"][0, 7:9].tolist() == [31, prompt[-1]]
    text_only = pack(prompts, responses, "cpu")
    assert text_only["position_ids"].shape == (1, 18) and text_only["mm"] is None


@pytest.mark.unit
def test_batches_keep_each_samples_images_through_select_and_concat():
    from rlcore.algo.batch import RolloutBatch, concat

    a, b = _vision_inputs(1, 1.0, 5), _vision_inputs(1, 2.0, 5)
    batch = RolloutBatch([[1]] * 4, [[2]] * 4, [[0.0]] * 4, ["x"] * 4, ["stop"] * 4, 2, vision=[a, a, b, b])
    assert batch.select([3, 0]).vision == [b, a]
    text = RolloutBatch([[1]], [[2]], [[0.0]], ["x"], ["stop"], 1)
    assert concat([batch, text]).vision == [a, a, b, b, None]
    assert concat([text, text]).vision is None


@pytest.mark.unit
def test_shapes_answers_are_exact():
    """The drawn image really holds what the answer says (count from the pixels' colours)."""
    import random

    from rlcore.demo.vl import COLOURS, draw_shapes, shapes_question

    rng = random.Random(3)
    for _ in range(40):
        image, shapes = draw_shapes(rng)
        question, answer = shapes_question(rng, shapes)
        present = set(zip(*[iter(image.tobytes())] * 3))  # the image's distinct RGB triples
        colours = {c for c, rgb in COLOURS.items() if rgb in present}
        assert colours == {s["colour"] for s in shapes}
        if question.startswith("how many"):
            assert answer == str(len(shapes))
        else:
            assert answer in colours


def test_geo3k_converter_keeps_images_and_placeholders(tmp_path):
    """The public Geometry3K Parquet schema (images: [{bytes, path}], problem, answer) -> rows the
    trainer loads: Parquet keeps the bytes, JSONL writes the images beside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(buf, format="PNG")
    rows = [{"images": [{"bytes": buf.getvalue(), "path": "a.png"}], "problem": "<image>Find x.", "answer": "3\\sqrt{13}"},
            {"images": [{"bytes": buf.getvalue(), "path": None}], "problem": "Find y.", "answer": "7"},
            {"images": [], "problem": "<image>No image.", "answer": "1"}]
    src = tmp_path / "train-00000.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    for out in (tmp_path / "geo.parquet", tmp_path / "geo.jsonl"):
        proc = subprocess.run([sys.executable, "scripts/convert_data.py", "geo3k", str(src), "--out", str(out),
                               "--instruction", ""], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0 and "wrote 2 rows" in proc.stdout, proc.stderr
    got = pq.read_table(tmp_path / "geo.parquet").to_pylist()
    assert [r["prompt"] for r in got] == ["<image>Find x.", "<image>Find y."]  # placeholder prepended when missing
    assert got[0]["answer"] == "3\\sqrt{13}" and got[0]["images"][0]["bytes"] == buf.getvalue()
    lines = [json.loads(x) for x in (tmp_path / "geo.jsonl").read_text().splitlines()]
    assert lines[0]["images"] == ["geo_images/000000_0.png"]
    assert (tmp_path / "geo_images" / "000000_0.png").read_bytes() == buf.getvalue()
