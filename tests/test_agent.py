"""Multi-turn, tool-using rollouts (rlcore/agent/): token exactness on the real vLLM engine with two
chat templates, the loss over masked tool tokens against a hand-built reference, the python tool's
sandbox against each way code goes wrong, the tools' schema checks, and bad configs (exit 2
before any model loads). The trainer end to end (and exact resume after kill -9) is in
tests/test_agent_e2e.py.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "agent_worker.py")
QWEN3_TEMPLATE = os.path.join(REPO, "configs", "chat_templates", "qwen3.jinja")
LOGPROB_TOL = 1e-4  # fp32 vLLM vs fp32 transformers forward


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    from rlcore.demo.tool import make_tool_model

    return make_tool_model(str(tmp_path_factory.mktemp("tool_model")))


@pytest.fixture(scope="session")
def chatml_model(tmp_path_factory) -> str:
    from rlcore.demo.tool import make_chatml_tool_model

    return make_chatml_tool_model(str(tmp_path_factory.mktemp("chatml_model")), QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def conv_runs(tool_model, chatml_model, tmp_path_factory) -> dict:
    """One launch, one engine per template in turn (a torchrun start and vLLM import saved)."""
    out = tmp_path_factory.mktemp("agent_worker") / "result.json"
    run_torchrun(WORKER, 1, str(out), f"tiny={tool_model}", f"qwen3={chatml_model}")
    return json.loads(out.read_text())


@pytest.fixture(params=["tiny", "qwen3"])
def conv_run(request, conv_runs) -> dict:
    return {"kind": request.param, **conv_runs[request.param]}


# --------------------------------------------------------------------------- real engine


def test_trained_ids_are_prompt_plus_vllm_ids_plus_template_deltas(conv_run):
    """Rebuilt from what the engine returned, call by call: every later turn's prompt is the
    conversation so far, exactly; the model's tokens are vLLM's ids (and log-probs) at env-mask 1;
    what lies between two turns is the template delta of that turn's tool messages, at env-mask 0."""
    convs, calls = conv_run["conversations"], conv_run["calls"]
    first = [s for g in calls[0]["outputs"] for s in g]  # n samples per prompt, prompt-major
    assert len(first) == len(convs)
    for k, c in enumerate(convs):
        seq, pos, turn_out = c["prompt_ids"] + c["response_ids"], len(c["prompt_ids"]), first[k]
        tool_runs = _tool_runs(c["messages"])
        for turn in range(c["turns"]):
            if turn > 0:  # find the call that continued this conversation: its prompt is seq[:pos]
                matches = [g[0] for call in calls[1:] for p, g in zip(call["prompts"], call["outputs"])
                           if p == seq[:pos]]
                assert len(matches) == 1, (k, turn)
                turn_out = matches[0]
            ids, logp, _ = turn_out
            ids = ids[: len(seq) - pos]  # the token budget may cut the last turn
            assert seq[pos: pos + len(ids)] == ids and all(c["env_mask"][pos - len(c["prompt_ids"]) + j] == 1
                                                            for j in range(len(ids)))
            r0 = pos - len(c["prompt_ids"])
            assert c["logprobs"][r0: r0 + len(ids)] == logp[: len(ids)]
            pos += len(ids)
            if turn < len(tool_runs):  # the delta of this turn's tool messages
                key = json.dumps(tool_runs[turn])
                want = (conv_run["deltas"] if ids[-1] == conv_run["eos"] else conv_run["deltas_no_eos"])[key]
                assert seq[pos: pos + len(want)] == want
                assert c["env_mask"][pos - len(c["prompt_ids"]): pos - len(c["prompt_ids"]) + len(want)] == [0] * len(want)
                pos += len(want)
        assert pos == len(seq), (k, pos, len(seq))
    assert conv_run["deltas"]  # tool turns happened


def test_multi_turn_happened_with_tool_messages(conv_run):
    convs = conv_run["conversations"]
    assert max(c["turns"] for c in convs) >= 2 and any(0 in c["env_mask"] for c in convs)
    if conv_run["kind"] == "tiny":  # the random model's own hermes calls, answered with the secret
        called = [c for c in convs if c["tool_calls"]]
        assert called and all(c["tool_messages"] for c in called)


def test_model_token_logprobs_match_transformers(conv_run):
    assert conv_run["hf_vs_vllm_max"] < LOGPROB_TOL


def test_seeded_conversations_are_reproducible(conv_run):
    """The same seed gives the same conversations (a resumed step samples what the first did)."""
    assert conv_run["repeat_equal"]


def _tool_runs(messages: list[dict]) -> list[list[dict]]:
    runs, cur = [], []
    for m in messages + [{"role": "end"}]:
        if m["role"] == "tool":
            cur.append({"role": "tool", "content": m["content"]})
        elif cur:
            runs.append(cur)
            cur = []
    return runs


# --------------------------------------------------------------------------- templates and parsing


@pytest.mark.unit
def test_qwen3_delta_rebuilds_the_templates_own_rendering(chatml_model):
    """Prompt text + the sampled turn (ending <|im_end|>) + the delta == Qwen3's template rendering
    the whole conversation: the "\\n" after <|im_end|> belongs to the delta."""
    from transformers import AutoTokenizer

    from rlcore.agent.chat import ChatRenderer

    tok = AutoTokenizer.from_pretrained(chatml_model)
    r = ChatRenderer(tok, [{"type": "function", "function": {"name": "calculator", "parameters": {}}}])
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    user = [{"role": "user", "content": "What is 2+3?"}]
    tools = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "ok"}]
    turn = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = r.prompt_ids(user) + turn + r.delta_ids(tools, ended_with_eos=True)
    full = r.render(user + [{"role": "assistant", "content": call}] + tools, True)
    assert tok.decode(ids) == full
    assert r.turn_end == "\n"


def test_vllm_parser_reads_calls_and_counts_malformed_ones(tool_model):
    from transformers import AutoTokenizer

    from rlcore.agent.chat import ToolCallParser
    from rlcore.demo.tool import CALL, LOOKUP_SCHEMA

    tok = AutoTokenizer.from_pretrained(tool_model)
    p = ToolCallParser("hermes", tok, [LOOKUP_SCHEMA])
    assert p.parse(tok.decode([tok.convert_tokens_to_ids(CALL)])).calls == [("lookup", "{}")]
    assert p.parse("7").calls == [] and not p.parse("7").malformed
    bad = p.parse('<tool_call>{"name": lookup}</tool_call>')
    assert bad.calls == [] and bad.malformed


# --------------------------------------------------------------------------- loss over tool tokens


@pytest.mark.unit
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_masked_tool_tokens_loss_and_gradient_match_hand_reference(agg):
    """Two conversations (model, tool, model tokens) and a single-turn one: the GRPO loss and its
    gradient equal a reference that only ever looks at the model tokens; tool tokens get zero."""
    from rlcore import advantage
    from rlcore.algo.batch import RolloutBatch

    env_mask = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1], [1, 1, 1]]
    responses = [[5] * len(m) for m in env_mask]
    batch = RolloutBatch([[1, 2]] * 3, responses, [[0.0] * len(m) for m in env_mask], ["x"] * 3,
                              ["stop"] * 3, 3, env_mask=env_mask)
    mask = batch.response_mask()  # (N, T)
    adv = advantage.compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.5]), mask, 3)
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(mask.shape, generator=g)).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(mask.shape, generator=g)
    loss, _ = advantage.policy_loss("vanilla", logp, old, adv, mask, agg_mode=agg, norm_len=10)
    loss.backward()
    # Reference: per conversation, only its model tokens, by hand.
    a = [1.0, 0.0, 0.5]
    mean, std = sum(a) / 3, torch.tensor(a).std().item()
    ref_terms = []
    for i, m in enumerate(env_mask):
        terms = []
        for t, keep in enumerate(m):
            if keep:
                ratio = torch.exp(logp[i, t] - old[i, t])
                A = (a[i] - mean) / (std + 1e-6)
                terms.append(torch.maximum(-A * ratio, -A * torch.clamp(ratio, 0.8, 1.2)))
        ref_terms.append(terms)
    if agg == "token-mean":
        ref = sum(sum(t) for t in ref_terms) / sum(len(t) for t in ref_terms)
    elif agg == "seq-mean-token-sum":
        ref = sum(sum(t) for t in ref_terms) / 3
    elif agg == "seq-mean-token-mean":
        ref = sum(sum(t) / len(t) for t in ref_terms) / 3
    else:
        ref = sum(sum(t) for t in ref_terms) / 3 / 10
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    grad_ref = torch.autograd.grad(ref, logp)[0]
    assert torch.allclose(logp.grad, grad_ref, atol=1e-7)
    tool = torch.tensor([[1 - x for x in m] + [0] * (mask.shape[1] - len(m)) for m in env_mask], dtype=torch.bool)
    assert (logp.grad[tool] == 0).all() and (adv[tool] == 0).all()


# --------------------------------------------------------------------------- sandbox


SANDBOX_CASES = {
    "timeout": ("import time\ntime.sleep(60)", "timeout"),
    "infinite_output": ("while True:\n    print('x' * 1000)", "output_limit"),
    "memory_bomb": ("x = bytearray(8 * 1024**3)", "MemoryError"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "os.fork"),
    "socket_connect": ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)", "socket"),
    "env_secret": ("import os\nprint(os.environ['RLCORE_TEST_SECRET'])", "KeyError"),
    "write_outside": ("open('/tmp/rlcore_sandbox_escape.txt', 'w').write('x')", "not allowed"),
    "exception": ("raise ValueError('boom')", "ValueError: boom"),
}


@pytest.mark.parametrize("case", list(SANDBOX_CASES))
def test_python_tool_failure_is_a_tool_error_not_a_trainer_error(case, monkeypatch):
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import ToolRunner, load_tools

    monkeypatch.setenv("RLCORE_TEST_SECRET", "hunter2")
    code, expected = SANDBOX_CASES[case]
    runner = ToolRunner(load_tools(["python"], None), Limits(timeout_s=2.0, cpu_s=2, memory_mb=256,
                                                              output_bytes=4096), workers=2)
    start = time.perf_counter()
    [result] = runner.run([("python", {"code": code})])
    runner.shutdown()
    assert result.error is not None and expected in result.content, result
    assert "hunter2" not in result.content
    assert time.perf_counter() - start < 10
    assert not os.path.exists("/tmp/rlcore_sandbox_escape.txt")
    if case == "timeout":
        assert result.timed_out


@pytest.mark.serial
def test_python_tool_runs_code_in_an_empty_directory_and_calls_run_concurrently():
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import ToolRunner, load_tools

    runner = ToolRunner(load_tools(["python"], None), Limits(timeout_s=5.0), workers=4)
    start = time.perf_counter()
    code = "import os, time\ntime.sleep(2)\nopen('a.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')), 6 * 7)"
    results = runner.run([("python", {"code": code})] * 4)
    runner.shutdown()
    assert [r.content for r in results] == ["['a.txt'] 42\n"] * 4 and all(r.error is None for r in results)
    assert time.perf_counter() - start < 6.0  # four 2 s calls side by side (one after another: 8 s)


# --------------------------------------------------------------------------- tools


def _hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "done"


def test_tools_calculator_user_function_errors_and_hangs():
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import Tool, ToolRunner, calculator, load_tools, tool_schema

    assert calculator("(12 + 7) * 3") == "57" and calculator("7/2") == "3.5"
    tools = {**load_tools(["calculator"], None), "_hang": Tool("_hang", _hang, tool_schema(_hang))}
    runner = ToolRunner(tools, Limits(timeout_s=0.5), workers=4)
    res = runner.run([("calculator", '{"expression": "2**10"}'), ("calculator", '{"expression": "__import__(1)"}'),
                      ("calculator", '{"x": 1}'), ("nope", "{}"), ("calculator", "not json"), ("_hang", {"seconds": 2})])
    runner.shutdown()
    assert res[0].content == "1024" and res[0].error is None
    assert [r.error for r in res[1:]] == ["raised", "bad_arguments", "unknown_tool", "bad_arguments", "timeout"]


@pytest.mark.unit
def test_tool_schema_must_match_the_signature(tmp_path):
    from rlcore.agent.tools import load_tools
    from rlcore.task.rewards import load_custom_fn

    f = tmp_path / "my_tools.py"
    f.write_text("def lookup(key: str, limit: int = 3) -> str:\n    return key\n")
    good = {"name": "lookup", "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                              "required": ["key"]}}
    assert "lookup" in load_tools([{"fn": f"{f}:lookup", "schema": good}], load_custom_fn)
    bad = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    with pytest.raises(ValueError, match="requires \\['key'\\]"):
        load_tools([{"fn": f"{f}:lookup", "schema": bad}], load_custom_fn)
    with pytest.raises(ValueError, match="no schema could be derived"):
        load_tools([f"{f}:lookup"], load_custom_fn)  # no docstring: say how to fix it


# --------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize("extra,expected", [
    (["--rollout.tool_parser", "hermes2"], "rollout.tool_parser='hermes2' is not one of vLLM's tool parsers"),
    (["--tools", '["no_such_file.py:f"]'], "file no_such_file.py does not exist"),
    (["--tools", '["{bad}"]'], "no schema could be derived"),
    (["--tools", '[{"fn": "{bad}", "schema": {"name": "f", "parameters": {"properties": {"y": {}}}}}]'],
     "the schema does not match the function: the function requires ['x']"),
    (["--env.cls", "rlcore.demo.tool:make_tool_data"], "has no reset / step method"),
    (["--rollout.multi_turn.enable", "false"], "rollout.multi_turn.enable=false"),
    (["--rollout.multi_turn.max_total_tokens", "100"], "must fit rollout.max_model_len=64"),
    (["--rollout.multi_turn.chat_template", "nope.jinja"], "rollout.multi_turn.chat_template"),
], ids=["parser", "tool_import", "schema", "schema_mismatch", "env_class", "tools_without_multi_turn", "budget", "template"])
def test_bad_multi_turn_config_exits_2_before_any_model(extra, expected, tool_model, tmp_path, capsys):
    import sys

    from rlcore.demo.tool import make_tool_data

    train, _ = make_tool_data(str(tmp_path / "data"), n_train=8, n_val=2)
    nodoc = tmp_path / "nodoc.py"
    nodoc.write_text("def f(x: int) -> int:\n    return x\n")
    extra = [e.replace("{bad}", f"{nodoc}:f") for e in extra]
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_bad_inputs import checks_exit_code

    argv = ["--config", os.path.join(REPO, "configs", "demo_tool_cpu.yaml"), "--model.path", tool_model,
            "--data.train_files", json.dumps([train]), "--data.val_files", "[]",
            "--trainer.output_dir", str(tmp_path / "out"), *extra]
    if "--rollout.multi_turn.enable" in extra:
        argv += ["--env.cls", "null", "--tools", '["calculator"]', "--reward.components", '{"math": 1.0}']
    assert checks_exit_code(argv, 2) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "import vllm" not in err


@pytest.mark.unit
def test_first_turn_prefix_is_prompt_and_the_parser_reads_the_turn_with_it(chatml_model):
    """first_turn_prefix opens the first turn in the prompt (not trained); the turn's text the
    parser reads starts with it, so a call the prefix opened is a call."""
    from transformers import AutoTokenizer

    from rlcore.agent.chat import ChatRenderer, ToolCallParser
    from rlcore.agent.loop import Agent, Conversation
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import ToolRunner, load_tools
    from rlcore.colocate_rollout import Sample

    tok = AutoTokenizer.from_pretrained(chatml_model)
    tools = load_tools(["calculator"], None)
    prefix = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
    r = ChatRenderer(tok, [t.schema for t in tools.values()], first_turn_prefix=prefix)
    user = [{"role": "user", "content": "What is 2+3?"}]
    assert r.prompt_text(user) == r.render(user, True) + prefix
    agent = Agent(tok, r, ToolCallParser("hermes", tok, r.tools), ToolRunner(tools, Limits(), 1), max_turns=2,
                  max_total_tokens=64, max_tool_response_tokens=8)
    ids = tok('2 + 3"}}\n</tool_call>', add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    c = Conversation(r.prompt_ids(user), [])
    kind, parsed = agent.take_turn(c, Sample(ids, [0.0] * len(ids), "stop"))
    assert kind == "calls" and parsed.calls == [("calculator", '{"expression": "2 + 3"}')]
    [outcome] = agent.outcomes([(c, (kind, parsed))])
    agent.apply([(c, (kind, parsed))], [outcome])
    agent.runner.shutdown()
    assert c.tool_calls == 1 and c.finish is None
    assert tok.decode(c.response_ids).endswith("<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.unit
def test_env_reward_combines_with_rule_rewards():
    from rlcore.task.rewards import score_samples

    totals, correct, metrics = score_samples(["7", "7", "3"], ["7", "7", "7"], {"env": 1.0, "first_word_match": 0.5},
                                             env_rewards=[1.0, None, 0.2])
    assert totals == pytest.approx([1.5, 0.5, 0.2])
    assert correct == [True, False, False] and metrics["reward/env"] == pytest.approx(0.4)
