"""Black-box agents through the rank's OpenAI-compatible endpoint (rlcore/agent/serve.py) on the real
vLLM engine: unmodified OpenAI-SDK agents in their own processes (tests/workers/agents.py), recorded
token-exactly; agents that fail are contained; bad configs stop before any model loads.

One launch (tests/workers/agent_endpoint_worker.py) serves two models in turn: the tool demo's
word-level one and a byte-level BPE one with Qwen3's chat template (where decoding and encoding a
reply again need not give back its ids).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "agent_endpoint_worker.py")
QWEN3_TEMPLATE = os.path.join(REPO, "configs", "chat_templates", "qwen3.jinja")
LOGPROB_TOL = 1e-4  # fp32 vLLM vs an fp32 transformers forward
FAILURE = {"raise": "raised", "hang": "timeout", "crash": "crashed", "malformed": "malformed", "wrong_key": "raised"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from rlcore.demo.tool import make_chatml_tool_model, make_tool_model

    root = tmp_path_factory.mktemp("agent_endpoint")
    tiny = make_tool_model(str(root / "tiny"))
    qwen3 = likely_eos(make_chatml_tool_model(str(root / "qwen3"), QWEN3_TEMPLATE))
    out = root / "result.json"
    run_torchrun(WORKER, 1, str(out), f"tiny={tiny}", f"qwen3={qwen3}", timeout=900)
    return json.loads(out.read_text())


def likely_eos(model_dir: str, scale: float = 20.0) -> str:
    """The random model ends a turn (EOS) about 1 token in 10 instead of 1 in 400: its EOS row of the
    LM head scaled up, so that replies end their turn and histories can extend them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    weights["lm_head.weight"][AutoTokenizer.from_pretrained(model_dir).eos_token_id] *= scale
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(params=["tiny", "qwen3"])
def run(request, runs) -> dict:
    return {"kind": request.param, **runs[request.param]}


def _by_episode(contents: list[dict], episodes: list[dict]) -> dict[int, list[dict]]:
    """Each episode's responses in order (an episode's requests are sequential)."""
    out = {ep["index"]: [] for ep in episodes}
    for c in contents:
        out[c["episode"]].append(c)
    return out


def _walk(segment: dict, completions: list[dict]) -> int:
    """Check one segment against the engine's own records; returns how many completions it holds.

    From its prompt on, each run of mask-1 tokens is exactly one completion the engine produced for
    a prompt equal to the segment up to there (ids and log-probs as returned, nothing else at mask 1),
    and what lies between two of them (mask 0) is context the next request added."""
    seq, mask, logp = segment["prompt_ids"] + segment["response_ids"], segment["env_mask"], segment["logprobs"]
    base, pos, used = len(segment["prompt_ids"]), len(segment["prompt_ids"]), 0
    assert len(mask) == len(logp) == len(segment["response_ids"])
    while pos < len(seq):
        if mask[pos - base] == 0:
            pos += 1
            continue
        match = [c for c in completions if c["prompt"] == seq[:pos] and seq[pos: pos + len(c["ids"])] == c["ids"]]
        assert match, f"the sampled run at {pos} is no completion of the engine's"
        c = match[0]
        r0, n = pos - base, len(c["ids"])
        assert mask[r0: r0 + n] == [1] * n and logp[r0: r0 + n] == c["logprobs"]
        pos, used = pos + n, used + 1
    return used


def _expected_segments(mode: str, responses: list[dict], eos: int) -> int:
    """A request starts a segment when it is the first, when the previous reply did not end its turn
    (EOS), or when the agent rewrote the history: compact before turns 1 and 3, strip whenever the
    reply it echoes had a word to cut. Text completions always extend."""
    if mode == "text":
        return 1
    count = 1
    for turn in range(1, len(responses)):
        prev = responses[turn - 1]
        rewrote = (mode == "compact" and turn % 2 == 1) or (mode == "strip" and bool((prev["content"] or "").split()))
        count += rewrote or not prev["ids"] or prev["ids"][-1] != eos
    return count


def test_every_segment_is_the_engines_own_tokens_and_the_policys_log_probs(run):
    """Per segment: the sampled tokens are the engine's ids at mask 1 and nothing else is, the log-probs
    are vLLM's and equal a teacher-forced transformers forward of the policy (fp32, 1e-4)."""
    for part in ("exact", "after"):
        data = run[part]
        responses = _by_episode(data["contents"], data["episodes"])
        for ep, diffs in zip(data["episodes"], data["teacher_diff"]):
            assert ep["finish"] == "stop", (ep["mode"], ep["error"])
            assert sum(_walk(s, data["completions"]) for s in ep["segments"]) == ep["requests"] == len(
                responses[ep["index"]])
            assert max(diffs) < LOGPROB_TOL, (run["kind"], ep["mode"], diffs)
            assert len(ep["segments"]) == _expected_segments(ep["mode"], responses[ep["index"]], run["eos"]), ep["mode"]


def test_append_only_histories_are_one_sample_and_rewritten_ones_several(run):
    episodes = run["exact"]["episodes"]
    appended = [e for e in episodes if e["mode"] == "append" and e["appended"] > 0]
    assert appended, "no append-only request was served"
    assert all(e["requests"] == 4 for e in episodes if e["mode"] == "compact")
    assert any(len(e["segments"]) >= 3 for e in episodes if e["mode"] == "compact")
    m = run["exact"]["metrics"]
    assert m["agent/failures"] == 0 and m["agent/episodes"] == 2 * len({e["mode"] for e in episodes})
    assert 1.0 < m["agent/segments_mean"] < m["agent/requests_mean"]
    assert 0.0 < m["agent/append_only_frac"] < 1.0 and m["timing/agent_request_s"] > 0.0


def test_forced_tool_choices_call_the_tool_every_time_and_record_the_policys_log_probs(runs):
    """tool_choice required / a named function (an OpenAI-SDK agent, vLLM's grammar): every reply calls the
    calculator and ends its turn (the grammar ends, then EOS), so the echoed call extends the history (one
    segment); the engine's log-probs of such a sample are the grammar-masked distribution's, so each is
    scored again, and what the episode records is the policy's (the teacher-forced check above covers
    these episodes' segments too)."""
    data = runs["qwen3"]["exact"]
    forced = [e for e in data["episodes"] if e["mode"] in ("required", "named")]
    import vllm

    if int(vllm.__version__.split(".")[1]) < 32:
        # vllm 0.23 (the NPU twin) constrains hermes by the tools' JSON schema, as its server does (no
        # structural tag for hermes there: tool_parsers/abstract_tool_parser.py:117-150, :172-173). The schema
        # allows any whitespace between tokens, which the tiny random model samples until its token
        # budget ends, so no call completes; the replies are still the grammar's (scored again below).
        assert len(forced) == 4 and all(e["requests"] == 2 for e in forced), forced
        assert all(len(e["segments"]) + e["appended"] == e["requests"] for e in forced), forced
    else:
        assert len(forced) == 4 and all(e["finish"] == "stop" and e["requests"] == 2 == e["env_reward"]
                                        for e in forced)
        assert all(len(e["segments"]) == 1 and e["appended"] == 1 for e in forced)
    scored = [c for c in data["completions"] if "masked" in c]
    assert len(scored) == sum(e["requests"] for e in forced)
    assert max(abs(a - b) for c in scored for a, b in zip(c["masked"], c["logprobs"])) > 0.5


def test_failing_agents_end_their_episode_with_reward_0_and_nothing_else(run):
    """raise / hang past its limit / crash / malformed request / wrong key: the episode fails with its
    kind and reward 0; the append agents of the same call and the next call are served as usual; the
    endpoint is not reachable beyond loopback."""
    eps = run["failures"]["episodes"]
    for e in eps:
        if e["mode"] in FAILURE:
            assert e["finish"] == "failed" and e["failure"] == FAILURE[e["mode"]] and e["env_reward"] == 0.0, e
        else:
            assert e["finish"] == "stop" and e["failure"] is None, e
    assert all(e["env_reward"] in (1.0, 0.5) for e in eps if e["mode"] == "outside")
    m = run["failures"]["metrics"]
    assert m["agent/failures"] == 10 and m["agent/failures_timeout"] == 2 and m["agent/failures_malformed"] == 2
    assert "Error code: 401" in next(e["error"] for e in eps if e["mode"] == "wrong_key")
    assert run["after"]["metrics"]["agent/failures"] == 0


def test_turns_batching_gives_the_same_episodes_for_the_same_seeds(run):
    first, second = run["turns"]
    assert [e["segments"] for e in first] == [e["segments"] for e in second]
