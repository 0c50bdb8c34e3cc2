"""The colocated engine one scheduler step at a time: continuous batching for the agent endpoint
(rlcore/agent/serve.py), where requests arrive while others decode.

``ColocateRollout.generate`` hands vLLM a batch and waits for all of it; here requests are queued with
``LLMEngine.add_request`` as they come (under ids of our own: ``LLM.enqueue`` returns vLLM's internal
ids, ``<n>-<random suffix>``, while outputs and aborts use the external ones) and ``LLMEngine.step``
runs one iteration over whatever is queued or running, returning the requests that finished; what
``LLM.generate`` does in a loop (vllm 0.32.0 entrypoints/common/offline.py ``_add_request``, final
outputs only, and ``_run_engine``; v1/engine/llm_engine.py ``add_request`` / ``step`` /
``abort_request`` / ``has_unfinished_requests``, which vllm 0.23.0 has too: v1/engine/llm_engine.py:182-287). Each request is seeded as generate seeds
a prompt (rollout.checks.request_seed: the call's seed key, the DP replica), samples at the run's
temperature and returns the sampled tokens' log-probs, inside the engine's own RNG stream, globals
and compile stance (the rollout's, passed in: this wing's parts never import colocate_rollout).
With TP > 1 every rank of the group makes the same enqueue and step calls in the same order.

A request may carry a grammar (vLLM's ``SamplingParams.structured_outputs``: the agent endpoint's
``tool_choice: required`` or a named function). vLLM masks the logits with it before sampling
(vllm 0.32.0 v1/worker/gpu_model_runner.py:4333-4340 ``apply_grammar_bitmask``, then ``_sample``;
the V2 runner's v1/worker/gpu/model_runner.py:1618-1627 likewise), so the log-probs it returns are the masked
distribution's, renormalised over the tokens the grammar allows, not the policy's. ``score`` gets the
policy's: the prompt and the sampled ids go in again as a prompt with ``prompt_logprobs=0`` (one
prefill: vLLM skips the prefix cache for such a request, sampling_params.py:622-629), and vLLM returns
log_softmax(logits) of every prompt token (gpu_model_runner.py:5382-5388: no temperature, no top-k or
top-p), which is the policy's log-prob at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.rollout.checks import prompt_input, request_seed


@dataclass
class Finished:
    request_id: str
    token_ids: list[int]  # sampled, the stop/EOS token included when it ended the request
    logprobs: list[float]  # log_softmax(logits / T) of each sampled token, as generate returns them
    finish_reason: str  # "stop" | "length"
    cached_tokens: int  # prompt tokens vLLM's prefix cache served


class EngineSteps:
    """``rollout``: a built ColocateRollout (its llm, dp_rank, and the scopes generate runs in)."""

    def __init__(self, rollout):
        self.rollout = rollout
        self.count = 0  # requests submitted: their ids, the same on the ranks of a TP group
        self.scoring: dict[str, int] = {}  # score requests: id -> where the scored ids start in the prompt

    def submit(self, prompt_ids: list[int], *, seed: str, max_tokens: int, temperature: float, top_p: float = 1.0,
               top_k: int = -1, stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
               structured_outputs=None) -> str:
        """Queue one request (one sample); returns its id. ``stop`` strings and ``stop_token_ids`` end
        it early (vLLM detokenizes only when there are stop strings); they change no probability.
        ``structured_outputs``: vLLM's StructuredOutputsParams, a grammar the sample must follow (its
        log-probs are then the masked distribution's: see ``score``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ro = self.rollout
        params = SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=request_seed(seed, ro.dp_rank, 0), stop=list(stop or []) or None,
                                stop_token_ids=[*ro._slot_tokens, *(stop_token_ids or [])], logprobs=0,
                                detokenize=bool(stop), output_kind=RequestOutputKind.FINAL_ONLY,
                                structured_outputs=structured_outputs)
        return self._add(prompt_ids, params)

    def score(self, prompt_ids: list[int], start: int) -> str:
        """Queue a request that scores ``prompt_ids[start:]`` with the policy (log_softmax of its logits,
        temperature 1): its Finished holds those ids and their log-probs (see the module docstring)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        rid = self._add(prompt_ids, params)
        self.scoring[rid] = start
        return rid

    def _add(self, prompt_ids: list[int], params) -> str:
        ro = self.rollout
        ro._require_awake("submit", {"weights", "kv_cache"})
        self.count += 1
        rid = f"agent-{self.count}"
        with ro._engine_rng_scope():
            ro.llm.llm_engine.add_request(rid, prompt_input(prompt_ids, None), params,
                                          lora_request=ro._adapter().get("lora_request"))
        return rid

    def step(self) -> list[Finished]:
        """One engine iteration; the requests it finished."""
        ro = self.rollout
        with ro._engine_rng_scope(), ro._compile_stance():
            outputs = ro.llm.llm_engine.step()
        done = []
        for out in outputs:
            if not out.finished:
                continue
            start = self.scoring.pop(out.request_id, None)
            if start is not None:  # prompt_logprobs[i]: {prompt id i: its log-prob} (None at position 0)
                ids = list(out.prompt_token_ids[start:])
                done.append(Finished(out.request_id, ids, [d[t].logprob for t, d in
                                                           zip(ids, out.prompt_logprobs[start:])], "stop", 0))
                continue
            c = out.outputs[0]
            ids = list(c.token_ids)
            done.append(Finished(out.request_id, ids, [d[t].logprob for t, d in zip(ids, c.logprobs)],
                                 c.finish_reason, int(out.num_cached_tokens or 0)))
        return done

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            for rid in request_ids:
                self.scoring.pop(rid, None)
            self.rollout.llm.llm_engine.abort_request(list(request_ids))

    def busy(self) -> bool:
        return self.rollout.llm.llm_engine.has_unfinished_requests()
