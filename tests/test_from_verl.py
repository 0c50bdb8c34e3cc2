"""scripts/from_verl.py (rlcore/verl/): verl launch scripts in, this project's YAML out.

Conversions checked by hand against verl's semantics (each citing verl 1dda039's line), the three
classes of keys, verl's reward (its scorer, custom function and reward model), the entry points and
Hydra flags verl's scripts use, the launch line and bad inputs (the shell reader's constructs are
tests/test_verl_shell.py's). Every
fixture's outcome is tests/test_verl_examples.py's. All in process (the unit set); the script as a
user runs it, in a child interpreter, is tests/test_from_verl_cli.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from conftest import REPO
from rlcore.verl import cli, keys as verl_keys

pytestmark = pytest.mark.unit

FIX = os.path.join(REPO, "tests", "fixtures", "verl")
A, R, REF, M = verl_keys.A, verl_keys.R, verl_keys.REF, verl_keys.M
BASE = ["algorithm.adv_estimator=grpo", "data.train_batch_size=8", A + "ppo_mini_batch_size=8"]


def convert(argv: list[str], capsys, env: dict | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if env and monkeypatch:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def yaml_of(argv, capsys, **kw) -> tuple[dict, str, str]:
    import yaml

    rc, out, err = convert(argv, capsys, **kw)
    assert rc == 0, err
    return yaml.safe_load(out), out, err


def comment_of(text: str, key: str) -> str:
    line = next(line for line in text.splitlines() if re.match(rf"\s*{key}: ", line))
    return line.split("  # ", 1)[1]


# ----------------------------------------------------------------------------- what changed training silently


def test_lora_alpha_is_verls_16_when_unset(capsys):
    """verl's HFModelConfig.lora_alpha defaults to 16 (verl/workers/config/model.py:125); here 32."""
    cfg, text, _ = yaml_of(["--", *BASE, M + "lora_rank=8"], capsys)
    assert cfg["lora"] == {"rank": 8, "alpha": 16.0} and "(verl default)" in comment_of(text, "alpha")
    cfg, _, _ = yaml_of(["--", *BASE, M + "lora_rank=8", M + "lora_alpha=64"], capsys)
    assert cfg["lora"]["alpha"] == 64.0


def test_clip_ratio_alone_changes_nothing_as_in_verl(capsys):
    """verl's losses read clip_ratio_low/high, 0.2 by default (verl/workers/config/actor.py:159-161,
    core_algos.py:1321-1322): clip_ratio=0.3 alone leaves the clip at 0.2; with clip_ratio_low=null
    verl falls back to clip_ratio."""
    cfg, text, _ = yaml_of(["--", *BASE, A + "clip_ratio=0.3"], capsys)
    assert cfg["algorithm"].get("clip_low", 0.2) == 0.2 and cfg["algorithm"].get("clip_high", 0.2) == 0.2
    assert "actor_rollout_ref.actor.clip_ratio=0.3: no effect in verl" in text
    cfg, _, _ = yaml_of(["--", *BASE, A + "clip_ratio=0.3", A + "clip_ratio_low=null"], capsys)
    assert cfg["algorithm"]["clip_low"] == 0.3 and cfg["algorithm"].get("clip_high", 0.2) == 0.2


def test_gradient_checkpointing_is_verls_true_when_unset(capsys):
    """verl's enable_gradient_checkpointing defaults to true (verl/workers/config/model.py:117); here false."""
    cfg, text, _ = yaml_of(["--", *BASE], capsys)
    assert cfg["model"]["gradient_checkpointing"] is True and "(verl default)" in comment_of(text, "gradient_checkpointing")
    cfg, _, _ = yaml_of(["--", *BASE, M + "enable_gradient_checkpointing=False"], capsys)
    assert cfg["model"]["gradient_checkpointing"] is False


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+", "k1+", "abs+"])
def test_straight_through_kl_is_written_as_is(kind, capsys):
    """verl's kl_penalty takes the gradient from k2 for a '+' kind (core_algos.py:2199-2212): the same
    estimator here (rlcore/advantage.py; parity in tests/test_loss_modes.py)."""
    cfg, _, err = yaml_of(["--", *BASE, A + "use_kl_loss=True", f"{A}kl_loss_type={kind}"], capsys)
    assert cfg["algorithm"]["kl_loss_type"] == kind and "plain estimator" not in err


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"])
def test_loss_agg_modes_are_verls(mode, capsys):
    cfg, _, _ = yaml_of(["--", *BASE, f"{A}loss_agg_mode={mode}"], capsys)
    assert cfg["algorithm"]["loss_agg_mode"] == mode


@pytest.mark.parametrize("mode", ["gpg", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "gspo"])
def test_verls_policy_losses_are_written(mode, capsys):
    extra = [f"{A}loss_agg_mode=seq-mean-token-mean"] if mode == "gspo" else []
    cfg, _, _ = yaml_of(["--", *BASE, f"{A}policy_loss.loss_mode={mode}", *extra], capsys)
    assert cfg["algorithm"]["policy_loss"] == mode


@pytest.mark.parametrize("mode, why", [("kl_cov", "KL-Cov"), ("dro", "DRO"), ("nonsense", "no policy loss")])
def test_a_loss_mode_this_project_lacks_is_class_3_not_a_config_that_fails_later(mode, why, capsys):
    rc, out, err = convert(["--", *BASE, f"{A}policy_loss.loss_mode={mode}"], capsys)
    assert rc == 2 and out == "" and f"{A}policy_loss.loss_mode={mode}" in err and why in err
    rc, out, _ = convert(["--allow-unmapped", "--", *BASE, f"{A}policy_loss.loss_mode={mode}"], capsys)
    assert rc == 0 and "What this run does NOT do" in out and "policy_loss:" not in out


def test_gspo_aggregates_as_verl_or_is_refused(capsys):
    """verl's gspo aggregates its policy loss by seq-mean-token-mean whatever loss_agg_mode says
    (core_algos.py:1598-1600): written so when nothing else is aggregated, refused when a KL loss
    would need the other mode."""
    cfg, text, _ = yaml_of(["--", *BASE, f"{A}policy_loss.loss_mode=gspo"], capsys)
    assert cfg["algorithm"]["loss_agg_mode"] == "seq-mean-token-mean" and "gspo" in comment_of(text, "loss_agg_mode")
    rc, _, err = convert(["--", *BASE, f"{A}policy_loss.loss_mode=gspo", A + "use_kl_loss=True"], capsys)
    assert rc == 2 and A + "loss_agg_mode" in err and "one mode here" in err


def test_log_prob_token_budget_defaults_as_verls(capsys):
    """verl's rollout/ref log_prob_use_dynamic_bsz and log_prob_max_token_len_per_gpu default to the
    actor's use_dynamic_bsz and ppo_max_token_len_per_gpu (verl/trainer/config/rollout/rollout.yaml:113,
    117; ref/ref.yaml:20, 24): the budget is written though the script names only the actor's."""
    cfg, text, _ = yaml_of(["--", *BASE, A + "use_dynamic_bsz=True", A + "ppo_max_token_len_per_gpu=9000"], capsys)
    assert cfg["algorithm"]["micro_batch_tokens"] == 9000 and cfg["algorithm"]["log_prob_micro_batch_tokens"] == 9000
    assert "use_dynamic_bsz=true (verl default)" in comment_of(text, "log_prob_micro_batch_tokens")
    cfg, _, _ = yaml_of(["--", *BASE, A + "use_dynamic_bsz=True", R + "log_prob_max_token_len_per_gpu=4000",
                         A + f"ulysses_sequence_parallel_size=2"], capsys)
    assert cfg["algorithm"]["log_prob_micro_batch_tokens"] == 2 * 4000  # the smaller (the rollout's), per Ulysses group


def test_every_mapped_default_that_differs_is_written_with_verls_value(capsys):
    """Each plain copy (keys.MAPPED) the script leaves unset whose verl default differs from this
    project's is written with verl's value (the verl default in its comment); the others are not."""
    from rlcore.verl.convert import AUTO_EQUAL, cast, project_defaults, project_keys
    from rlcore.verl.defaults import Defaults

    cfg_text = convert(["--", *BASE], capsys)[1]
    written = {m.group(1) for m in re.finditer(r"# (\S+)=\S+ \(verl default\)", cfg_text)}
    defaults, types, project = Defaults("ppo_trainer", {}), project_keys(), project_defaults()
    for key, (target, _) in verl_keys.MAPPED.items():
        value = defaults.value(key)
        if value is None or target not in types:
            continue
        differs = cast(target, value, types, key) != project[target] and AUTO_EQUAL.get(target, object()) != value
        assert (key in written) == differs, (key, value, project[target])


def test_the_veomni_engine_brings_its_own_defaults(capsys):
    """model_engine=veomni selects verl's VeOmni defaults (optim/veomni.yaml: a cosine schedule, lr_min)."""
    cfg, text, _ = yaml_of(["--", *BASE, "model_engine=veomni"], capsys)
    assert cfg["optim"]["lr_schedule"] == "cosine" and "(verl default)" in comment_of(text, "lr_schedule")
    cfg, _, _ = yaml_of(["--", *BASE], capsys)
    assert "lr_schedule" not in cfg["optim"]  # verl's FSDP engine: constant, as here


# ----------------------------------------------------------------------------- classes of keys


def test_ray_profiler_and_kernel_keys_are_comments_never_errors(capsys):
    keys = ["ray_kwargs.ray_init.runtime_env.py_executable=null", R + "val_kwargs.top_k=-1",
            A + "entropy_from_logits_with_chunking=True", A + "fsdp_config.entropy_checkpointing=True",
            A + "fsdp_config.reshard_after_forward=True", A + "fsdp_config.forward_prefetch=True",
            A + "fsdp_config.offload_policy=True", A + "fsdp_config.use_orig_params=True",
            A + "fsdp_config.model_dtype=bf16", A + "fsdp_config.mixed_precision.param_dtype=bf16",
            R + "ignore_eos=False", "data.val_batch_size=64", A + "checkpoint.save_contents=['model']",
            "global_profiler.tool=torch", A + "grad_clip=0.5"]
    cfg, text, _ = yaml_of(["--", *BASE, *keys], capsys)
    comments = text.split("# verl keys with no effect on what is trained here:", 1)[1]
    for k in keys:
        assert f"#   {k}:" in comments, k
    assert cfg["optim"].get("grad_clip", 1.0) == 1.0  # actor.grad_clip is read nowhere in verl: optim.clip_grad


@pytest.mark.parametrize("override, key, value", [
    (A + "optim.optimizer=AdamW", "optim.optimizer", "adamw"),
    (A + "optim.clip_grad=0.5", "optim.grad_clip", 0.5),
    (R + "dtype=bfloat16", "rollout.dtype", "bfloat16"),
    (R + "response_length=300", "rollout.max_response_length", 300),
    (A + "ppo_micro_batch_size=64", "algorithm.micro_batch_size", 8),  # / 8 GPUs, verl's dp
    (R + "log_prob_micro_batch_size=32", "algorithm.log_prob_micro_batch_size", 4),
    (A + "veomni.router_replay.mode=R3", "algorithm.routing_replay", "r3"),
    (R + "enable_rollout_routing_replay=True", "algorithm.routing_replay", "r3"),
    ("algorithm.rollout_correction.rollout_is=token", "rollout_correction.is_level", "token"),
    ("algorithm.rollout_correction.rollout_rs=seq_mean_k3", "rollout_correction.rs", "seq_mean_k3"),
    (A + "policy_loss.loss_mode=clip_cov", "exploration.clip_cov_ratio", 0.0002),
])
def test_keys_with_an_equivalent_map(override, key, value, capsys):
    extra = ["algorithm.rollout_correction.rollout_rs_threshold=0.01"] if "rollout_rs=" in override else []
    cfg, _, _ = yaml_of(["--", *BASE, override, *extra], capsys)
    section, name = key.split(".")
    assert cfg[section][name] == value


def test_rollout_correction_icepop_and_k1_bounds(capsys):
    p = "algorithm.rollout_correction."
    cfg, _, _ = yaml_of(["--", *BASE, p + "rollout_is=sequence", p + "rollout_is_threshold='0.5_4.0'",
                         p + "rollout_rs=token_k1", p + "rollout_rs_threshold='0.6_1.6'"], capsys)
    assert cfg["rollout_correction"] == {"is_level": "sequence", "is_high": 4.0, "is_mode": "mask", "is_low": 0.5,
                                         "is_mask_normalizer": "all", "rs": "token_k1", "rs_threshold": 1.6,
                                         "rs_low": 0.6}
    rc, _, err = convert(["--", *BASE, p + "rollout_rs=token_k1,seq_max_k2", p + "rollout_rs_threshold=1"], capsys)
    assert rc == 2 and "one criterion here" in err


def test_dapo_keys_at_verls_current_places(capsys):
    """With verl's dapo reward manager (recipe.dapo.main_dapo's default): overlong_buffer_cfg at reward.reward_kwargs
    (verl's DAPOReward ramps to max_resp_len), filter_groups -> dynamic sampling, acc -> the score
    before the penalty."""
    base = [*BASE, "data.max_response_length=100", "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=0",
            "data.gen_batch_size=24"]
    for prefix, extra in (("reward.reward_kwargs.overlong_buffer_cfg.", ["reward.reward_kwargs.max_resp_len=100",
                                                                          "reward.reward_manager.name=dapo"]),
                          ("reward_model.reward_kwargs.overlong_buffer_cfg.",
                           ["reward_model.reward_kwargs.max_resp_len=100", "reward_model.reward_manager=dapo"]),
                          ("reward_model.overlong_buffer.", ["reward_model.reward_manager=dapo"])):
        cfg, _, _ = yaml_of(["--", *base, prefix + "enable=True", prefix + "len=20", prefix + "penalty_factor=0.5",
                             *extra], capsys)
        a = cfg["algorithm"]
        assert (a["overlong_buffer_len"], a["overlong_penalty_factor"]) == (20, 0.5), prefix
        assert a["dynamic_sampling"] and a["dynamic_sampling_metric"] == "score" and a["max_sampling_rounds"] == 100
    rc, _, err = convert(["--", *base, "reward_model.reward_manager=dapo", "reward.reward_kwargs.overlong_buffer_cfg."
                          "enable=True", "reward.reward_kwargs.overlong_buffer_cfg.len=20",
                          "reward.reward_kwargs.max_resp_len=80"], capsys)
    assert rc == 2 and "max_resp_len" in err and "make them equal" in err
    cfg, text, _ = yaml_of(["--", *BASE, "reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                            "reward.reward_kwargs.overlong_buffer_cfg.len=20"], capsys)  # the naive manager: off in verl
    assert "overlong_buffer_len" not in cfg["algorithm"] and "dapo reward manager" in text


def test_distillation_maps_to_distill(capsys):
    d = "distillation."
    cfg, _, _ = yaml_of(["--", *BASE, d + "enabled=True", d + "teacher_models.teacher_model.model_path=/t",
                         d + "teacher_models.teacher_model.inference.gpu_memory_utilization=0.4",
                         d + "distillation_loss.loss_mode=k1", d + "distillation_loss.use_policy_gradient=True",
                         d + "distillation_loss.use_task_rewards=False", d + "distillation_loss.loss_max_clamp=10.0",
                         d + "n_gpus_per_node=8"], capsys)
    assert cfg["distill"] == {"teacher": "/t", "gpu_memory_utilization": 0.4, "mode": "reverse_kl",
                              "advantage_clamp": 10.0, "reward_weight": 0.0, "coef": 1.0}
    rc, _, err = convert(["--", *BASE, d + "enabled=True", f"+{d}teacher_models.a.model_path=/a",
                          f"+{d}teacher_models.b.model_path=/b"], capsys)
    assert rc == 2 and "one teacher per run here" in err and "not a verl key" not in err
    cfg, _, _ = yaml_of(["--", *BASE, d + "enabled=False", d + "distillation_loss.topk=64"], capsys)
    assert "distill" not in cfg


@pytest.mark.parametrize("override", ["algorithm.use_kl_in_reward=True",
                                      "trainer.critic_warmup=5", A + "strategy=megatron", "critic.enable=True",
                                      R + "ignore_eos=True"])
def test_no_effect_keys_at_another_value_change_training(override, capsys):
    rc, _, err = convert(["--", *BASE, override], capsys)
    assert rc == 2 and override in err


def _model_folder(tmp_path, **config) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return str(folder)


def test_max_position_embeddings_override_is_decided_from_the_models_rope(tmp_path, capsys):
    """verl sets override_config on the trainer's HF config only (verl/workers/config/model.py:204-220) and
    bounds vLLM's max_model_len by it (vllm_async_server.py:993-1002). With RoPE that does not read it
    nothing trained changes (a comment); with rope_scaling, or a model that is not here, it is class 3."""
    key = M + "override_config.max_position_embeddings"
    plain = _model_folder(tmp_path, rope_scaling=None, text_config={"rope_scaling": {"rope_type": "default"}})
    argv = ["--", *BASE, M + f"path={plain}", "data.max_prompt_length=512", "data.max_response_length=512"]
    cfg, text, _ = yaml_of([*argv, f"{key}=32768"], capsys)
    assert "max_position_embeddings" not in json.dumps({k: v for k, v in cfg.items() if k != "model"}) \
        and set(cfg["model"]) <= {"path", "gradient_checkpointing", "dtype"} and f"{key}=32768: 32768: verl sets it on the trainer's config" in text
    rc, _, err = convert([*argv, f"{key}=1000"], capsys)  # below prompt + response: verl refuses it too
    assert rc == 2 and "is below rollout.max_model_len=1024" in err
    yarn = tmp_path / "yarn"
    yarn.mkdir()
    (yarn / "config.json").write_text(json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    rc, _, err = convert(["--", *BASE, M + f"path={yarn}", f"{key}=32768"], capsys)
    assert rc == 2 and "reads max_position_embeddings" in err
    rc, _, err = convert(["--", *BASE, M + "path=Qwen/Qwen3-8B", f"{key}=32768"], capsys)
    assert rc == 2 and "is not a local model folder here" in err


# ----------------------------------------------------------------------------- verl's reward


VERL_FN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return float(solution_str.strip() == ground_truth) + bonus
"""


def test_verls_default_reward_is_the_verl_component(capsys):
    """No custom function and no reward model: verl scores by each row's data_source
    (default_compute_score, verl/utils/reward_score/__init__.py): reward.components {verl: 1.0}, and
    nothing says another reward applies."""
    cfg, text, err = yaml_of(["--", *BASE], capsys)
    assert cfg["reward"] == {"components": {"verl": 1.0}}
    assert "default_compute_score by each row's data_source" in comment_of(text, "components")
    assert "math" not in err and "issue 65" not in err and "port the function" not in text + err


@pytest.mark.parametrize("section", ["reward.custom_reward_function.", "custom_reward_function."])
def test_custom_reward_function_becomes_reward_fn(section, tmp_path, capsys, monkeypatch):
    """verl's custom_reward_function (both places) -> reward.fn path:name + reward.fn_kwargs, the only
    component (verl scores with it alone). A relative path is taken from the directory the converter
    runs in (verl takes it from its launch directory) and written absolute; the name defaults to
    verl's compute_score; reward_kwargs as one mapping or dotted keys. The file exists here, so this
    project's parse loads it and binds verl's call with the kwargs."""
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(VERL_FN)
    monkeypatch.chdir(tmp_path)
    cfg, text, err = yaml_of(["--", *BASE, section + "path=rewards/mine.py", f"+{section}reward_kwargs.bonus=0.5"],
                             capsys)
    assert cfg["reward"] == {"fn": f"{tmp_path}/rewards/mine.py:compute_score", "fn_kwargs": {"bonus": 0.5},
                             "components": {"custom": 1.0}}
    assert f"rewards/mine.py taken from {tmp_path}" in comment_of(text, "fn") and "(verl default)" in comment_of(text, "fn")
    assert "not on this machine" not in err
    cfg, _, _ = yaml_of(["--", *BASE, f"{section}path={tmp_path}/rewards/mine.py", section + "name=compute_score",
                         "+" + section + "reward_kwargs={bonus: 1.0}"], capsys)
    assert cfg["reward"]["fn"] == f"{tmp_path}/rewards/mine.py:compute_score" and cfg["reward"]["fn_kwargs"] == {"bonus": 1.0}
    rc, _, err = convert(["--", *BASE, section + "path=rewards/mine.py", f"+{section}reward_kwargs.nope=1"], capsys)
    assert rc == 2 and "this project refuses reward.fn" in err and "nope" in err  # the call would not bind
    rc, _, err = convert(["--", *BASE, section + "path=rewards/mine.py", section + "name=missing"], capsys)
    assert rc == 2 and "has no callable named 'missing'" in err


def test_custom_reward_function_not_on_this_machine_is_written_and_said(tmp_path, capsys, monkeypatch):
    """verl's own examples name files of verl's repository (verl/utils/reward_score/openr1mm.py),
    relative to where verl runs: written absolute from the converter's directory, with a note; the
    trainer refuses it at start-up until the file is there."""
    monkeypatch.chdir(tmp_path)
    cfg, _, err = yaml_of(["--", *BASE, "reward.custom_reward_function.path=verl/utils/reward_score/openr1mm.py"],
                          capsys)
    assert cfg["reward"]["fn"] == f"{tmp_path}/verl/utils/reward_score/openr1mm.py:compute_score"
    assert cfg["reward"]["components"] == {"custom": 1.0}
    assert f"reward.fn: {tmp_path}/verl/utils/reward_score/openr1mm.py is not on this machine" in err
    cfg, _, err = yaml_of(["--", *BASE, "reward.custom_reward_function.path=pkg://my_rewards.math",
                           "reward.custom_reward_function.name=score"], capsys)
    assert cfg["reward"]["fn"] == "my_rewards.math:score" and "my_rewards.math is not on this machine" in err


def test_the_top_level_custom_reward_function_replaces_the_nested_one(tmp_path, capsys, monkeypatch):
    """verl's migration (experimental/reward_loop/reward_loop.py:58-60): custom_reward_function, when
    it sets anything, replaces reward.custom_reward_function whole."""
    (tmp_path / "a.py").write_text(VERL_FN)
    (tmp_path / "b.py").write_text(VERL_FN)
    monkeypatch.chdir(tmp_path)
    cfg, text, _ = yaml_of(["--", *BASE, "custom_reward_function.path=a.py", "reward.custom_reward_function.path=b.py",
                            "+reward.custom_reward_function.reward_kwargs.bonus=1"], capsys)
    assert cfg["reward"]["fn"] == f"{tmp_path}/a.py:compute_score" and "fn_kwargs" not in cfg["reward"]
    assert "#   reward.custom_reward_function.path=b.py: verl reads custom_reward_function.*" in text
    cfg, _, _ = yaml_of(["--", *BASE, "custom_reward_function.path=null", "reward.custom_reward_function.path=b.py"],
                        capsys)
    assert cfg["reward"]["fn"] == f"{tmp_path}/b.py:compute_score"


@pytest.mark.parametrize("legacy", [False, True])
def test_verls_reward_model_is_a_discriminative_judge_alone(legacy, tmp_path, capsys):
    """verl's reward model without a custom function (experimental/reward_loop/reward_loop.py:145-156,
    compute_score_disrm): the head's raw value (classify, use_activation=False) is the whole reward,
    no rule score added -> one discriminative reward.models entry, the only component. Its context
    is verl's max_model_len, whose null is the model's max_position_embeddings (read from a local
    folder; else the rollout budget, said)."""
    rm = (tmp_path / "rm")
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                "max_position_embeddings": 131072}))
    p = "reward_model." if legacy else "reward.reward_model."
    path_key = "reward_model.model.path" if legacy else p + "model_path"
    cfg, text, err = yaml_of(["--", *BASE, p + "enable=True", f"{path_key}={rm}", p + "rollout.name=vllm",
                              p + "rollout.gpu_memory_utilization=0.3", p + "rollout.tensor_model_parallel_size=1",
                              p + "rollout.enforce_eager=True"], capsys)
    assert cfg["reward"] == {"components": {"reward_model": 1.0}, "models": [
        {"name": "reward_model", "path": str(rm), "kind": "discriminative", "activation": "none", "dtype": "bfloat16",
         "gpu_memory_utilization": 0.3, "max_model_len": 131072}]}
    assert "max_position_embeddings 131072" in comment_of(text, "models")
    for key in ("rollout.name=vllm", "rollout.tensor_model_parallel_size=1", "rollout.enforce_eager=True"):
        assert f"#   {p}{key}:" in text, key
    cfg, _, err = yaml_of(["--", *BASE, "data.max_prompt_length=3000", p + "enable=True", f"{path_key}=org/rm",
                           p + "rollout.prompt_length=1000", p + "rollout.response_length=1000"], capsys)
    assert cfg["reward"]["models"][0]["max_model_len"] == 3000 + 512  # at least the policy's prompt + response
    assert "reward.models[0].max_model_len=3512" in err and "overlong_frac" in err


def test_a_reward_model_with_a_custom_function_or_quantized_is_class_3(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.py").write_text(VERL_FN)
    monkeypatch.chdir(tmp_path)
    rm = ["reward.reward_model.enable=True", "reward.reward_model.model_path=/rm"]
    rc, _, err = convert(["--", *BASE, *rm, "reward.custom_reward_function.path=a.py"], capsys)
    assert rc == 2 and "reward.reward_model.enable=True: verl scores with the custom reward function alone" in err
    rc, _, err = convert(["--", *BASE, *rm, "reward.reward_model.rollout.quantization=fp8"], capsys)
    assert rc == 2 and "a quantized reward model" in err
    rc, _, err = convert(["--", *BASE, "reward_model.enable=True"], capsys)
    assert rc == 2 and "reward_model.enable=True: no reward_model.model_path" in err
    cfg, text, _ = yaml_of(["--", *BASE, "reward.reward_model.enable=False", "reward.reward_model.model_path=/rm"],
                           capsys)
    assert cfg["reward"] == {"components": {"verl": 1.0}} and "read by verl only with reward_model.enable=True" in text


# ----------------------------------------------------------------------------- entry points and Hydra


def script(tmp_path, body: str) -> str:
    path = tmp_path / "run.sh"
    path.write_text("#!/bin/bash\n" + body)
    return str(path)


def test_dapo_through_ray_job_submit(tmp_path, capsys):
    path = script(tmp_path, "ray job submit --no-wait --runtime-env=x.yaml --working-dir . \\\n"
                            "    -- python3 -m recipe.dapo.main_dapo " + " ".join(BASE) + " trainer.project_name=p\n")
    cfg, _, err = yaml_of([path], capsys)
    assert "recipe.dapo.main_dapo: read as dapo_trainer" in err
    assert cfg["trainer"]["output_dir"] == "checkpoints/p/gsm8k"


@pytest.mark.parametrize("entry, expect", [("recipe.partial_rollout.main_ppo", True), ("verl.trainer.main_ppo_sync", None)])
def test_recipe_entry_points(entry, expect, tmp_path, capsys):
    path = script(tmp_path, f"python3 -m {entry} {' '.join(BASE)} +async_training.partial_rollout=True\n")
    rc, out, err = convert([path], capsys)
    if expect:
        assert rc == 0 and "partial:\n    enable: true" in out
    else:  # the recipe's key on plain verl: its fully asynchronous trainer's
        assert rc == 2 and "async_training.partial_rollout" in err


def test_config_name_selects_verls_defaults_and_group_overrides_are_refused(tmp_path, capsys):
    rc, _, err = convert(["--", "--config-path=config", "--config-name=ppo_megatron_trainer", *BASE], capsys)
    assert rc == 2 and A + "strategy=megatron (verl default)" in err and "Megatron" in err
    cfg, text, err = yaml_of(["--", "--config-name=ppo_veomni_trainer.yaml", *BASE], capsys)
    assert cfg["optim"]["lr_schedule"] == "cosine" and "verl's ppo_veomni_trainer defaults" in err
    assert "--config-path" not in err
    rc, _, err = convert(["--", *BASE, "actor@actor_rollout_ref.actor=mlite_actor"], capsys)
    assert rc == 2 and "Hydra's group override" in err and "mlite_actor" in err


# ----------------------------------------------------------------------------- the launch line


def test_the_launch_line_has_absolute_paths_wherever_the_converter_ran(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = convert(["-o", "cfg.yaml", "--", *BASE, "trainer.n_gpus_per_node=4"], capsys)
    assert rc == 0
    line = next(x for x in err.splitlines() if "torchrun" in x).removeprefix("from_verl.py: ")
    torchrun, standalone, nproc, train, flag, config = line.split()
    assert torchrun == os.path.join(REPO, ".venv", "bin", "torchrun") and nproc == "--nproc_per_node=4"
    assert standalone == "--standalone"  # a free rendezvous port on one node
    assert train == os.path.join(REPO, "train_grpo.py") and config == str(tmp_path / "cfg.yaml")
    dry = next(x for x in err.splitlines() if "dry run first" in x)
    assert os.path.join(REPO, ".venv", "bin", "python") in dry and os.path.join(REPO, "scripts", "check_config.py") in dry


def test_an_ascend_script_is_converted_for_npu_from_its_own_exports(tmp_path, capsys):
    path = script(tmp_path, "export HCCL_CONNECT_TIMEOUT=1500\nexport TASK_QUEUE_ENABLE=1\nexport VLLM_USE_V1=1\n"
                            "export RAY_DEDUP_LOGS=0\nexport PYTORCH_NPU_ALLOC_CONF=expandable_segments:True\n"
                            "export VLLM_ASCEND_ENABLE_NZ=1\npython3 -m verl.trainer.main_ppo " + " ".join(BASE) +
                            " trainer.n_gpus_per_node=16\n")
    cfg, _, err = yaml_of([path, "-o", str(tmp_path / "npu.yaml")], capsys)
    cfg = __import__("yaml").safe_load(open(tmp_path / "npu.yaml"))
    assert cfg["parallel"]["device"] == "npu"
    assert "the script exports HCCL_CONNECT_TIMEOUT" in open(tmp_path / "npu.yaml").read()
    sbatch = next(x for x in err.splitlines() if "sbatch" in x)
    assert "DEVICE=npu NPROC_PER_NODE=16" in sbatch and "--gpus-per-node" not in sbatch and f"cd {REPO}" in sbatch
    launch = next(x for x in err.splitlines() if "torchrun" in x)
    assert "HCCL_CONNECT_TIMEOUT=1500 TASK_QUEUE_ENABLE=1" in launch and "RAY_" not in launch and "NZ" not in launch
    assert "VLLM_USE_V1=1: not needed here" in err and "RAY_DEDUP_LOGS=0: not needed here" in err
    assert "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True: harmful here" in err
    assert "VLLM_ASCEND_ENABLE_NZ=1: harmful here" in err and "--device npu" in err


def test_several_nodes_launch_through_slurm_from_the_repository(capsys):
    rc, _, err = convert(["--", *BASE, "trainer.nnodes=2", "trainer.n_gpus_per_node=8"], capsys)
    assert rc == 0 and f"cd {REPO} && mkdir -p logs && sbatch --nodes=2 --gpus-per-node=8" in err


# ----------------------------------------------------------------------------- hand-checked conversions


def test_lora_gsm8k_script_by_hand(capsys, monkeypatch):
    """verl's run_qwen2_5-3b_gsm8k_grpo_lora.sh: 16 prompts a step in mini-batches of 16 prompts -> 1
    mini-batch; its KL loss (low_var_kl, 0.001); LoRA 64/32; log-prob micro-batches 40 on both sides."""
    monkeypatch.setenv("HOME", "/home/user")
    cfg, text, err = yaml_of([os.path.join(FIX, "run_qwen2_5-3b_gsm8k_grpo_lora.sh")], capsys)
    assert cfg["trainer"]["prompts_per_step"] == 16 and cfg["algorithm"]["mini_batches"] == 1
    assert cfg["algorithm"]["kl_loss_coef"] == 0.001 and cfg["algorithm"]["kl_loss_type"] == "low_var_kl"
    assert cfg["lora"] == {"rank": 64, "alpha": 32.0}
    assert cfg["algorithm"]["micro_batch_size"] == 40 and cfg["algorithm"]["log_prob_micro_batch_size"] == 40
    assert cfg["data"]["train_files"] == ["/home/user/data/gsm8k/train.parquet"]
    assert cfg["data"]["truncation"] == "filter" and cfg["data"]["shuffle"] is False
    assert cfg["data"]["answer_key"] == "reward_model.ground_truth" and cfg["data"]["apply_chat_template"] is True
    assert cfg["logging"]["trackers"] == ["wandb"] and cfg["logging"]["wandb"]["name"] == "qwen2.5_3b_grpo_lora"
    assert cfg["checkpoint"]["save_every"] == 20 and cfg["trainer"]["val_every"] == 5
    assert cfg["trainer"]["val_before_train"] is False and cfg["trainer"]["total_epochs"] == 15
    assert cfg["optim"] == {"lr": 3e-6, "weight_decay": 0.01}
    assert cfg["rollout"]["max_model_len"] == 512 + 1024 and cfg["rollout"]["max_response_length"] == 1024
    assert comment_of(text, "mini_batches") == "16 / actor_rollout_ref.actor.ppo_mini_batch_size=16"
    assert cfg["trainer"]["output_dir"] == "checkpoints/verl_grpo_example_gsm8k/qwen2.5_3b_grpo_lora"


def test_qwen3_8b_on_npu_by_hand(capsys, monkeypatch):
    """verl's run_qwen3_8b_fsdp.sh with DEVICE=npu: its npu branch sets 16 prompts, mini-batch 16, Ulysses 4;
    the 24576-token per-GPU budgets become 4 x 24576 per Ulysses group; its HCCL exports make it npu."""
    cfg, text, err = yaml_of([os.path.join(FIX, "run_qwen3_8b_fsdp.sh")], capsys, env={"DEVICE": "npu", "HOME": "/h"},
                             monkeypatch=monkeypatch)
    assert cfg["parallel"]["device"] == "npu" and cfg["parallel"]["ulysses_size"] == 4
    assert cfg["trainer"]["prompts_per_step"] == 16 and cfg["algorithm"]["mini_batches"] == 1
    assert cfg["algorithm"]["micro_batch_tokens"] == 4 * 24576
    assert cfg["algorithm"]["log_prob_micro_batch_tokens"] == 4 * 24576
    assert cfg["algorithm"]["log_prob_micro_batch_size"] == 1 and cfg["algorithm"]["micro_batch_size"] == 1
    assert cfg["offload"] == {"params": True, "optimizer": True, "ref": True}
    assert cfg["rollout"]["tensor_parallel_size"] == 4 and cfg["rollout"]["sync_bucket_mb"] == 4096
    assert cfg["data"]["max_prompt_length"] == 2048 and cfg["rollout"]["max_response_length"] == 32768
    assert cfg["data"]["train_files"] == ["/h/data/gsm8k/train.parquet", "/h/data/math/train.parquet"]
    assert "HCCL_CONNECT_TIMEOUT=1500" in next(x for x in err.splitlines() if "torchrun" in x)


def test_epochs_become_steps_from_readable_files(tmp_path, capsys):
    """verl runs total_epochs x (rows // train_batch_size) steps (its dataloader drops the last partial batch)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(50)))
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"prompt": [str(i) for i in range(30)]}), parquet)
    base = ["data.train_batch_size=16", A + "ppo_mini_batch_size=8", "trainer.total_epochs=3", "algorithm.adv_estimator=grpo"]
    cfg, text, _ = yaml_of(["--", f"data.train_files=['{jsonl}','{parquet}']", *base], capsys)
    assert cfg["trainer"]["total_steps"] == 3 * (80 // 16) and "total_epochs" not in cfg["trainer"]
    assert comment_of(text, "total_steps") == "trainer.total_epochs=3 x (80 rows // 16) as verl counts"
    cfg, _, _ = yaml_of(["--", f"data.train_files={jsonl}", *base, A + "optim.lr_warmup_steps_ratio=0.2",
                         A + "ppo_epochs=2"], capsys)
    assert cfg["optim"]["warmup_steps"] == int(0.2 * 9) * 2 * 2


def test_two_scripts_never_share_a_run_directory(capsys, monkeypatch):
    """verl's default_local_dir is checkpoints/{project_name}/{experiment_name}
    (verl/trainer/config/ppo_trainer.yaml): written when the script leaves it unset."""
    monkeypatch.setenv("HOME", "/home/user")
    dirs = set()
    for name in ("run_qwen2_5-3b_gsm8k_grpo_lora.sh", "run_qwen3_8b_fsdp.sh", "run_qwen3_4b_fsdp.sh"):
        cfg, _, _ = yaml_of([os.path.join(FIX, name)], capsys)
        dirs.add(cfg["trainer"]["output_dir"])
    assert len(dirs) == 3 and all(d.startswith("checkpoints/") for d in dirs)


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("argv, expected", [
    (["/no/such/script.sh"], "cannot read /no/such/script.sh"),
    (["--", "foo.bar=1"], "unknown key 'foo.bar'"),
    (["--", *BASE, "actor_rollout_ref.rollout.n=abc"], "rollout.n takes values of type int"),
    (["--", "trainer.logger"], "is not a verl override"),
    (["--", "data.train_batch_size=100", A + "ppo_mini_batch_size=64"], "not a multiple"),
    (["--", "data.train_files=[a, b"], "not a valid list"),
    ([], "give a verl launch script"),
    (["--", *BASE, "trainer.n_gpus_per_node=eight"], "trainer.n_gpus_per_node is 'eight', not an integer"),
    (["-o", "/no/such/dir/out.yaml", "--", *BASE], "cannot write"),
])
def test_bad_overrides_exit_2_with_one_paragraph(argv, expected, capsys):
    rc, out, err = convert(argv, capsys)
    assert rc == 2 and out == "" and expected in err and err.startswith("from_verl.py: error:"), err


def test_help_explains_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "--allow-unmapped" in out and "examples:" in out and "docs/from_verl.md" in out


# ----------------------------------------------------------------------------- the doc's key tables


def doc_keys(section: str) -> set[str]:
    """verl keys (a prefix ending in .* as the prefix) in the first column of the doc's table under ``section``."""
    text = open(os.path.join(REPO, "docs", "from_verl.md")).read()
    part = text.split(section, 1)[1].split("\n## ", 1)[0]
    found = set()
    for line in part.splitlines():
        if line.startswith("| `"):
            for span in re.findall(r"`\+?([^`]+)`", line.split("|")[1]):
                key = re.split(r"[:\s=]", span)[0].removesuffix(".*").removesuffix("*")
                if key.split(".")[0] in verl_keys.VERL_SECTIONS:
                    found.add(key)
    return found


def test_the_doc_lists_every_key_the_converter_knows_and_no_other():
    strip = lambda keys: {k.removesuffix(".*").rstrip(".") for k in keys}  # noqa: E731
    mapped = doc_keys("## verl keys and their keys here")
    known = strip(verl_keys.MAPPED) | strip(verl_keys.RULE_KEYS)
    assert mapped == known, mapped ^ known
    no_effect, known = doc_keys("## verl keys with no effect here"), strip(verl_keys.NO_EFFECT) | strip(verl_keys.NO_EFFECT_ONLY)
    assert no_effect == known, no_effect ^ known
    unmapped = doc_keys("## verl keys with no equivalent")
    assert unmapped == strip(verl_keys.UNMAPPED), unmapped ^ strip(verl_keys.UNMAPPED)
