"""The sync check's logic (rlcore/step/sync_check.py) and the CPU tied-head re-pack rule
(rlcore/rollout/cpu_repack.py), on hand-built values. The real engines run them in tests/test_weight_sync.py
and tests/test_e2e.py."""

from __future__ import annotations

import pytest
import torch

from rlcore.rollout.cpu_repack import cpu_repack_on_reload, cpu_tied_linears
from rlcore.step import sync_check



@pytest.mark.unit
def test_probe_sequences_skip_vision_tokens_short_prompts_and_cut_to_length():
    prompts = [[1, 2], [5, 99, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21, 22, 23]]
    # [1, 2] is too short; [5, 99, 6, 7, 8] keeps 4 tokens once 99 is removed, so it counts
    assert sync_check.probe_sequences(prompts, skip_ids=[99], n=2, max_len=5) == [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    assert sync_check.probe_sequences(prompts, skip_ids=[], n=1) == [[5, 99, 6, 7, 8]]
    assert sync_check.probe_sequences([[1, 2, 3]], n=2) == []


@pytest.mark.unit
def test_probe_batch_scores_the_second_half_as_a_response():
    b = sync_check.probe_batch([[1, 2, 3, 4, 5], [6, 7, 8, 9]])
    assert b.prompt_ids == [[1, 2], [6, 7]] and b.response_ids == [[3, 4, 5], [8, 9]]
    assert b.response_mask().tolist() == [[1, 1, 1], [1, 1, 0]]


@pytest.mark.unit
@pytest.mark.parametrize("name, group", [
    ("model.embed_tokens", "embedding"), ("model.layers.0", "layer 0"), ("model.layers.11", "layer 11"),
    ("model.norm", "final norm"), ("language_model.model.layers.3", "layer 3"),
    ("model.language_model.embed_tokens", "embedding"), ("model.language_model.norm", "final norm"),
    ("model.layers.0.self_attn", None), ("model.layers.0.input_layernorm", None), ("lm_head", None),
    ("model.visual.blocks.0", None), ("visual.merger.norm", None), ("model.visual.layers.1", None),
])
def test_group_names_match_hf_and_vllm_module_names(name, group):
    assert sync_check.group_of(name) == group


def _groups(values: dict[str, float]) -> dict[str, torch.Tensor]:
    return {k: torch.full((3, 4), v) for k, v in values.items()}


@pytest.mark.unit
def test_first_differing_group_is_the_first_in_forward_order():
    trainer = _groups({"embedding": 1.0, "layer 0": 2.0, "layer 1": 3.0, "layer 10": 4.0, "final norm": 5.0})
    # layer 10 sorts after layer 1 numerically, not as text; a 1e-3 relative error in layer 1
    engine = _groups({"embedding": 1.0, "layer 0": 2.0, "layer 1": 3.003, "layer 10": 4.5, "final norm": 5.0})
    group, detail = sync_check.first_differing_group(trainer, engine, rtol=1e-4, tokens=3)
    assert group == "layer 1" and "9.99e-04" in detail  # 0.003 / 3.003 and "layer 0 and all before it agree" in detail


@pytest.mark.unit
def test_every_hidden_group_agreeing_points_at_the_lm_head():
    trainer = _groups({"embedding": 1.0, "layer 0": 2.0, "final norm": 5.0})
    engine = _groups({"embedding": 1.0, "layer 0": 2.0 + 1e-6, "final norm": 5.0})
    assert sync_check.first_differing_group(trainer, engine, rtol=1e-4, tokens=3)[0] == "lm_head"
    assert sync_check.first_differing_group(trainer, {}, rtol=1e-4, tokens=3)[0] == "unknown"


@pytest.mark.unit
def test_only_the_compared_tokens_count():
    """vLLM may hold more rows (padding, a sampled token); the trainer's packed row holds the next
    sequence after the first: only the first ``tokens`` rows are compared."""
    a, b = torch.zeros(5, 2), torch.zeros(7, 2)
    a[4] = 9.0
    assert sync_check.first_differing_group({"embedding": a}, {"embedding": b}, 1e-4, tokens=4)[0] == "lm_head"


@pytest.mark.unit
def test_capture_groups_sums_vllm_layer_pairs_and_takes_the_normed_output():
    class Layer(torch.nn.Module):  # vLLM's decoder layer returns (hidden, residual)
        def forward(self, x):
            return x * 2, x + 1

    class Norm(torch.nn.Module):  # vLLM's final norm with a residual returns (normed, residual)
        def forward(self, x):
            return x / 2, x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Identity()
            self.layers = torch.nn.ModuleList([Layer()])
            self.norm = Norm()

    root = torch.nn.Module()
    root.model = Model()
    x = torch.ones(1, 3, 4)
    with sync_check.capture_groups(root) as got:
        h = root.model.embed_tokens(x)
        h = sum(root.model.layers[0](h))
        root.model.norm(h)
    assert set(got) == {"embedding", "layer 0", "final norm"}
    assert got["layer 0"].shape == (3, 4) and torch.equal(got["layer 0"], torch.full((3, 4), 4.0))  # 2 + 2
    assert torch.equal(got["final norm"], torch.full((3, 4), 2.0))
    assert not root.model.layers[0]._forward_hooks  # removed after the block


@pytest.mark.unit
def test_sync_check_modes_and_tolerances():
    assert sync_check.SyncCheck("warn", "float32", [[1, 2, 3, 4]], "cpu").tol == 1e-3
    assert sync_check.SyncCheck("strict", "bfloat16", [[1, 2, 3, 4]], "cpu").tol == 0.1
    assert sync_check.SyncCheck("warn", "float32", [[1, 2, 3, 4]], "cpu", tol=0.5).tol == 0.5
    assert not sync_check.SyncCheck("warn", "float32", [], "cpu").enabled
    assert not sync_check.SyncCheck("off", "float32", [[1, 2, 3, 4]], "cpu").enabled
    with pytest.raises(ValueError, match="off, warn or strict"):
        sync_check.SyncCheck("loud", "float32", [[1, 2, 3, 4]], "cpu")


@pytest.mark.unit
def test_check_sync_config_errors_name_the_key():
    from rlcore.config import ConfigError, RolloutConfig

    with pytest.raises(ConfigError, match=r"rollout.check_sync_tol=0 is invalid: it must be > 0"):
        RolloutConfig(check_sync_tol=0)


# ----------------------------------------------------------------------------- CPU tied-head re-pack


class _Method:
    """Stands in for vLLM's UnquantizedEmbeddingMethod: builds ``cpu_linear`` from the weight as
    vllm 0.32's dispatch_cpu_unquantized_gemm does (a packed COPY, here a clone)."""

    def process_weights_after_loading(self, layer):
        packed = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias: x @ packed.t()


def _tied_pair():
    embed, head = torch.nn.Module(), torch.nn.Module()
    shared = torch.nn.Parameter(torch.ones(4, 2), requires_grad=False)
    for m in (embed, head):
        m.weight = shared
        m.quant_method = _Method()
        m.quant_method.process_weights_after_loading(m)
    untied = torch.nn.Module()
    untied.weight = torch.nn.Parameter(torch.ones(3, 2), requires_grad=False)
    untied.quant_method = _Method()
    untied.quant_method.process_weights_after_loading(untied)
    model = torch.nn.Module()
    model.embed, model.head, model.other = embed, head, untied
    return model


@pytest.mark.unit
def test_tied_linears_are_found_by_shared_parameter_identity():
    model = _tied_pair()
    assert cpu_tied_linears(model) == [model.embed, model.head]
    del model.head.cpu_linear  # an accelerator: no CPU packed copy, nothing to do
    del model.embed.cpu_linear
    assert cpu_tied_linears(model) == []


def test_a_reload_through_the_embedding_repacks_the_tied_head():
    model = _tied_pair()
    x = torch.ones(1, 2)
    with cpu_repack_on_reload(model):
        model.embed.weight.data.mul_(3.0)  # what vLLM's layer-wise reload does: copy into the Parameter
        model.embed.quant_method.process_weights_after_loading(model.embed)  # only the loaded layer
    assert torch.equal(model.head.cpu_linear(x, None, None), torch.full((1, 4), 6.0))
    # without the re-pack the head would still compute with the old copy
    stale = _tied_pair()
    stale.embed.weight.data.mul_(3.0)
    assert torch.equal(stale.head.cpu_linear(x, None, None), torch.full((1, 4), 2.0))


# ----------------------------------------------------------------------------- the flow, on stand-ins


class _Policy:
    """Scores every token -1.0 (a stand-in for the trainer engine; the real one runs in test_e2e)."""

    model = torch.nn.Identity()

    def forward_logprobs(self, input_ids, position_ids, labels, temperature=1.0, with_entropy=False, grad=True,
                         **_):
        return torch.where(labels >= 0, -1.0, 0.0).float(), None


class _Rollout:
    def __init__(self, offset: float):
        self.offset, self.calls = offset, 0

    def score(self, seqs):
        self.calls += 1
        return [[-1.0 + self.offset] * (len(s) - 1) for s in seqs]

    def probe_module(self):
        return torch.nn.Identity()


@pytest.mark.unit
def test_agreeing_engine_passes_and_a_breach_warns_or_raises(caplog):
    probe = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    check = sync_check.SyncCheck("warn", "float32", probe, "cpu")
    assert check.before_sync(_Policy()).startswith("trainer scored 5 probe tokens")
    assert check.after_sync(_Rollout(0.0)).startswith("vLLM agrees")
    assert check.pop_metrics() == {"rollout/sync_probe_max": 0.0, "rollout/sync_probe_mean": 0.0}
    check.before_sync(_Policy())
    with caplog.at_level("WARNING", logger="rlcore.step.sync_check"):
        assert check.after_sync(_Rollout(0.01)).startswith("MISMATCH 1.00e-02 (unknown)")
    assert "max |d log-prob| 0.01 > rollout.check_sync_tol=0.001" in caplog.text
    assert check.pop_metrics()["rollout/sync_probe_mean"] == pytest.approx(0.01)
    strict = sync_check.SyncCheck("strict", "float32", probe, "cpu")
    strict.before_sync(_Policy())
    with pytest.raises(sync_check.SyncMismatchError, match="Stopped because rollout.check_sync=strict"):
        strict.after_sync(_Rollout(0.01))


@pytest.mark.unit
def test_check_sync_every_checks_the_first_sync_and_every_nth():
    check = sync_check.SyncCheck("warn", "float32", [[1, 2, 3, 4]], "cpu", every=3)
    rollout, done = _Rollout(0.0), []
    for _ in range(7):
        done.append(not check.before_sync(_Policy()).startswith("no-op"))
        check.after_sync(rollout)
    assert done == [True, False, False, True, False, False, True] and rollout.calls == 3


@pytest.mark.unit
def test_a_resumed_run_checks_its_resume_sync_and_then_the_uninterrupted_schedule():
    """Uninterrupted, every=3: the syncs after steps 1, 4, 7 are checked. Resumed from step 4's
    checkpoint: the resume's sync (step 4's weights) is checked whatever the schedule, then 7."""
    check = sync_check.SyncCheck("warn", "float32", [[1, 2, 3, 4]], "cpu", every=3)
    check.at_resume(5)  # a checkpoint of step 5: its sync is not due (5 - 1 = 4 is not a multiple of 3)
    assert not check.before_sync(_Policy()).startswith("no-op")
    check.after_sync(_Rollout(0.0))
    done = [not check.before_sync(_Policy()).startswith("no-op") for _ in (6, 7, 8)]  # steps 6, 7, 8
    assert done == [False, True, False]


@pytest.mark.unit
@pytest.mark.parametrize("mode,every,expect", [("warn", None, 10), ("strict", None, 1), ("warn", 3, 3),
                                               ("strict", 4, 4)])
def test_check_sync_every_defaults_to_every_sync_only_under_strict(mode, every, expect):
    from rlcore.config import Config, RolloutConfig
    from rlcore.config.resolve import resolve

    cfg = Config(rollout=RolloutConfig(check_sync=mode, check_sync_every=every))
    assert resolve(cfg, "cpu").rollout.check_sync_every == expect
