"""Ulysses sequence parallelism's own logic (rlcore.engine.ulysses), in-process: the whole row's
mask against transformers' packed-sequence rule, the response-only positions split by slices and
put back in order, and the config's refusals. The gradients against data parallelism on 2 real
ranks are in tests/test_grad_invariance.py; bad settings through the entry point in
tests/test_bad_inputs.py."""

import json
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.unit


def test_the_rows_mask_is_transformers_block_causal_mask_plus_an_isolated_padding():
    from transformers.masking_utils import find_packed_sequence_indices

    from rlcore.engine.ulysses import row_mask

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # three packed sequences, L = 9
    seq = find_packed_sequence_indices(pos)[0]  # transformers' sequence index of each position
    want = torch.tril(torch.ones(9, 9, dtype=torch.bool)) & (seq[:, None] == seq[None, :])
    mask = row_mask(pos, None, 12)[0, 0]  # padded to 12 (U = 4)
    assert torch.equal(mask[:9, :9], want)
    assert not mask[9:, :9].any() and not mask[:9, 9:].any()  # the padding sees nothing real
    assert torch.equal(mask[9:, 9:], torch.ones(3, 3, dtype=torch.bool).tril())  # and attends to itself
    given = torch.rand(1, 1, 9, 9) > 0.5  # a caller's shared-prompt mask is kept as is
    assert torch.equal(row_mask(pos, given, 12)[0, 0, :9, :9], given[0, 0])


def test_the_rows_segments_attend_as_its_block_causal_mask():
    """Per-sequence causal attention over ``row_segments`` (no mask) equals one sdpa over the whole
    row with ``row_mask`` (the dense path), padding included."""
    import torch.nn.functional as F

    from rlcore.engine.ulysses import row_mask, row_segments

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert row_segments(pos, 12) == [(0, 3), (3, 2), (5, 4), (9, 3)]
    assert row_segments(pos, 9) == [(0, 3), (3, 2), (5, 4)]
    q, k, v = torch.randn(3, 1, 2, 12, 8, generator=torch.Generator().manual_seed(0))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=row_mask(pos, None, 12))
    split = torch.cat([F.scaled_dot_product_attention(q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n],
                                                      is_causal=True) for a, n in row_segments(pos, 12)], 2)
    assert (dense - split).abs().max() < 1e-6


def test_selected_positions_split_by_slices_come_back_in_the_callers_order():
    from rlcore.engine.ulysses import shares

    g = torch.Generator().manual_seed(0)
    for u, length in ((2, 10), (4, 16), (4, 8)):
        select = torch.randint(0, length - 2, (13,), generator=g)  # repeated, unsorted (top-k rows)
        chunk = length // u
        bounds = [(r * chunk, (r + 1) * chunk) for r in range(u)]
        parts, order = shares(select, bounds)
        assert len({p.numel() for p in parts}) == 1  # equal sizes: gloo's all-gather needs them
        for (lo, hi), p in zip(bounds, parts):
            assert ((select[p[p >= 0]] >= lo) & (select[p[p >= 0]] < hi)).all()
        # what each rank computes for its share (the position itself stands for its log-prob)
        gathered = torch.cat([torch.where(p >= 0, select[p.clamp(min=0)], -1) for p in parts])
        assert torch.equal(gathered[order], select), (u, length)


def _cfg(tmp_path, heads, kv, u, attn="auto", extra=None):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv,
                                                      **(extra or {})}))
    return SimpleNamespace(parallel=SimpleNamespace(ulysses_size=u),
                           model=SimpleNamespace(path=str(tmp_path), attn_implementation=attn))


def test_npu_cu_seq_lens_stay_on_the_host(monkeypatch):
    """Issue 66 F4: transformers 5.5.4's NPU varlen kernel reads ``cu_seqlens_q[1:].cpu()`` and
    ``cu_seqlens_k[1:].cpu()`` in every attention call (integrations/npu_flash_attention.py:116-117,
    133-134): on npu the row's cu_seq_lens are built on the host, so both reads are of host memory (no
    device-to-host sync), and the kernel gets the sequences' end offsets. transformers' function runs
    here with ``npu_fusion_attention`` (torch_npu's, absent on CPU) as a recorder; CUDA keeps them on
    the device (flash-attn reads device tensors)."""
    from transformers.integrations import npu_flash_attention as nfa

    from rlcore.engine import ulysses

    assert ulysses.cu_seq_lens_device("npu:3") == torch.device("cpu")
    assert ulysses.cu_seq_lens_device("cuda:1") == torch.device("cuda:1")
    assert ulysses.cu_seq_lens_device(torch.device("cpu")) == torch.device("cpu")
    ctx = ulysses.Context(group=None, size=2, rank=0, flash=True)
    ctx.set_mask(None, segments=[(0, 5), (5, 3), (8, 4)])
    kw = ctx.flash_kwargs("npu:0")
    calls, reads = [], []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(self.device.type) or real_cpu(self))
    monkeypatch.setattr(nfa, "npu_fusion_attention", lambda *a, **k: calls.append(k) or [a[0]], raising=False)
    monkeypatch.setattr(nfa, "get_attn_mask_npu", lambda device: None)
    q = torch.zeros(12, 2, 32)  # (T, heads, head_dim): TND
    nfa.npu_flash_attn_varlen_func(q, q, q, kw["cu_seq_lens_q"], kw["cu_seq_lens_k"], causal=True)
    assert reads == ["cpu", "cpu"], reads  # both .cpu() reads were of host tensors
    assert calls[0]["actual_seq_qlen"] == calls[0]["actual_seq_kvlen"] == (5, 8, 12)


def test_ulysses_size_is_checked_against_the_world_and_the_heads(tmp_path):
    from rlcore.config import ConfigError
    from rlcore.run.preflight import _check_sequence_parallel

    _check_sequence_parallel(_cfg(tmp_path, 4, 2, 2), 4)
    _check_sequence_parallel(_cfg(tmp_path, 8, 1, 4), 4)  # KV heads repeated up to U
    _check_sequence_parallel(_cfg(tmp_path, 3, 3, 1), 4)  # off: nothing checked
    for kernel in ("sdpa", "flash_attention_2", "flash_attention_4"):  # what resolve gives on cpu, npu, Hopper
        _check_sequence_parallel(_cfg(tmp_path, 4, 2, 2, kernel), 4)
    bad = [((4, 2, 3), 4, "it must divide the world size 4 (e.g. 1, 2, 4)"),
           ((6, 6, 4), 4, "it must divide the model's 6 attention heads"),
           ((8, 6, 4), 4, "the model's 6 key/value heads must divide one another"),
           ((4, 2, 2, "eager"), 2, "not eager; set model.attn_implementation to auto (the device's kernel) or sdpa")]
    for args, world, text in bad:
        with pytest.raises(ConfigError, match="parallel.ulysses_size") as e:
            _check_sequence_parallel(_cfg(tmp_path, *args), world)
        assert text in str(e.value), str(e.value)
    text = {"num_attention_heads": 4, "num_key_value_heads": 2}
    for family, vit_heads in (("qwen3_vl", 4), ("qwen3_vl_moe", 2)):  # the ViT slices its patches too
        _check_sequence_parallel(_cfg(tmp_path, 4, 2, 2, extra={"model_type": family, "text_config": text,
                                                                "vision_config": {"num_heads": vit_heads}}), 2)
    for family, vit_heads, want in (("qwen2_5_vl", 4, "a qwen2_5_vl policy under sequence parallelism is not"),
                                    ("qwen3_vl", 3, "it must divide the vision tower's 3 attention heads")):
        with pytest.raises(ConfigError, match=want):
            _check_sequence_parallel(_cfg(tmp_path, 4, 2, 2, extra={"model_type": family, "text_config": text,
                                                                    "vision_config": {"num_heads": vit_heads}}), 2)


def test_the_plan_gives_each_rank_its_share_of_the_row_plus_the_whole_mask():
    """Qwen3-8B's shape, one 33,792-token sequence per micro-batch: with Ulysses 2 a rank's
    activations are those of a 16,896-token row (attended sequence by sequence), plus the row's
    (S, S) mask in bool and bf16 with shared prompts; the longest sequence the train phase fits per
    rank grows with the group."""
    import os
    from dataclasses import replace

    from rlcore.plan.inputs import PlanInputs
    from rlcore.plan.memory import activation_bytes
    from rlcore.plan.model_shape import ModelShape
    from rlcore.plan.sequence import longest_train_sequence, train_fits, ulysses_sizes

    shape = ModelShape.from_path(os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_8b"))
    p = PlanInputs(shape=shape, world=16, device_gb=80.0, micro_batch_size=1, prompt_len=1024, response_len=32768,
                   gradient_checkpointing=True, prompts_per_step=64, n=8, max_model_len=33792)
    half = activation_bytes(replace(p, prompt_len=512, response_len=16384))
    assert activation_bytes(replace(p, ulysses=2)) == half  # sequence by sequence: no mask
    assert activation_bytes(replace(p, ulysses=2, share_prompt=True)) == half + 33792 ** 2 * (1 + 2)
    assert ulysses_sizes(p) == [1, 2, 4, 8, 16]  # 32 heads, 8 key/value heads (repeated for 16), 16 ranks
    longest = [longest_train_sequence(p, u) for u in (1, 2, 4, 8)]
    assert longest == sorted(longest) and longest[0] < longest[-1], longest
    assert train_fits(p, longest[1], 2) and not train_fits(p, longest[1] + 256, 2)


def test_the_plan_gives_each_rank_its_share_of_the_patches_plus_the_images_mask():
    """Qwen3-VL-8B's vision tower (tests/fixtures/qwen3_vl_8b), a micro-batch of 4 all-image
    prompts of 1,024 image tokens: with Ulysses 2 a rank's blocks and mergers hold half the
    patches' activations (no mask: image by image); the gathered output stays whole."""
    import os
    from dataclasses import replace

    from rlcore.plan.inputs import PlanInputs
    from rlcore.plan.model_shape import ModelShape
    from rlcore.plan.vision import vision_activation_bytes

    shape = ModelShape.from_path(os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_vl_8b"))
    p = PlanInputs(shape=shape, world=16, device_gb=80.0, micro_batch_size=4, prompt_len=1024, response_len=1024,
                   gradient_checkpointing=True, prompts_per_step=64, n=8, max_model_len=2048)
    vis, tokens = shape.vision, p.micro_seqs * 1024
    output = 2 * tokens * vis.output_width() * 2
    full = vision_activation_bytes(p)
    half = vision_activation_bytes(replace(p, micro_batch_size=2))  # half the patches, half the output
    assert vision_activation_bytes(replace(p, ulysses=2)) == half - output // 2 + output
    assert full - output == 2 * (half - output // 2)  # blocks and mergers linear in the patches
    frozen = replace(p, freeze_vision=True)
    assert vision_activation_bytes(replace(frozen, ulysses=2)) == vision_activation_bytes(frozen)


def test_ulysses_takes_veomnis_flash_path_for_a_flash_kernel():
    """F1b: the attention a Ulysses policy runs for each resolved kernel, and the row's cu_seq_lens
    that go to VeOmni's flash path: the sdpa path's segments (the padding one of its own)."""
    from rlcore.engine import ulysses

    for impl in ulysses.FLASH:
        name, reason = ulysses.attention_for(impl, "why", 2)
        assert name == impl and "VeOmni's" in reason and "cu_seq_lens" in reason
    assert ulysses.attention_for("sdpa", "why", 2)[0] == ulysses.ATTN_NAME
    with pytest.raises(ValueError, match="attention eager has no Ulysses path"):
        ulysses.attention_for("eager", "why", 2)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # three packed sequences, 9 tokens, padded to 12 for U = 4
    ctx = ulysses.Context(group=None, size=4, rank=0, flash=True)
    ctx.set_mask(None, ulysses.row_segments(pos, 12))
    kw = ctx.flash_kwargs("cpu")
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 12] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["max_length_q"] == kw["max_length_k"] == 4
    assert ulysses.Context(group=None, size=4, rank=0).flash_kwargs("cpu") == {}  # the sdpa path passes none
    ctx.set_mask(torch.ones(1, 1, 12, 12, dtype=torch.bool))  # a shared-prompt row: no flash
    with pytest.raises(ValueError, match="share_prompt is off with them"):
        ctx.flash_kwargs("cpu")
