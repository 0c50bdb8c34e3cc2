"""Rule-based rewards and user reward functions.

Built-ins are ``fn(response: str, answer: str) -> float`` in a registry (``REWARDS``); a run's
reward is a weighted sum of named components (``reward.components``). A component registered with
``rows=True`` (``verl``: verl's scorer by the row's ``data_source``, rlcore.task.verl_scores) is
called ``fn(response, ground_truth, row)``: the row's value at data.answer_key as stored (not its
text) and the data row.

Custom reward (``reward.fn``): ``"package.module:function"`` (importable) or
``"path/to/file.py:function"`` (loaded from that file), with ``reward.fn_kwargs``. It enters the sum
as the component ``custom``. Its signature is read from its parameters (rlcore.task.reward_fn):

    def my_reward(response: str, answer: str) -> float               # one sample per call
    @rlcore.task.rewards.batched                                          # or set my_reward.batched = True
    def my_reward(responses: list[str], answers: list[str]) -> list[float]   # one call per batch
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)  # verl's
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)   # verl's, batched

A component's value is a number, or a dict with ``score`` (verl's scorers and functions return
them): the value is its score, and its ``acc``, when present, says whether the sample is correct.
Convention: a component scores in [0, 1], 1 meaning fully correct (verl's math_dapo scores -1 or
+1); ``reward/accuracy`` is the fraction of samples that every component passed: ``acc`` when the
component gave one, else a value >= 1 (full marks: verl's geo3k gives 0.9 to a right answer
outside the <think> format, which does not pass).

A call that raises, returns a non-number, or runs past ``reward.timeout_s`` (custom functions
only) gives ``reward.error_value`` to its sample(s), counts in ``reward/errors``, prints the first
traceback of the process once (naming the function and the row), and the run goes on.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import traceback
from typing import Callable

from rlcore.task import verl_scores
from rlcore.task.prompts import get_key
from rlcore.task.reward_fn import SINGLE_TURN, CustomReward, load_custom_fn  # noqa: F401 (load_custom_fn: re-exported)
from rlcore.task.timeouts import RewardTimeout, call_with_timeout  # noqa: F401 (the judge's parser uses them)

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}
ENV = "env"  # the component that is a multi-turn environment's own reward (rlcore.agent)
CUSTOM = "custom"  # component name of reward.fn


def register(name: str, rows: bool = False):
    """``rows``: the function is called ``fn(response, ground_truth, row)`` (see the module docstring)."""
    def wrap(fn: RewardFn) -> RewardFn:
        fn.takes_rows = rows
        REWARDS[name] = fn
        return fn

    return wrap


def batched(fn):
    """Mark a reward function as batched: ``fn(responses, answers) -> list[float]``."""
    fn.batched = True
    return fn


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(REWARDS)}")
    return REWARDS[name]


# ----------------------------------------------------------------------------- built-ins


@register("exact_match")
def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == str(answer).strip())


@register("first_word_match")
def first_word_match(response: str, answer: str) -> float:
    """1 when the response's first whitespace-separated word is the answer (toy tasks)."""
    words = response.split()
    return float(bool(words) and words[0] == str(answer).strip())


@register("math")
def math_answer(response: str, answer: str) -> float:
    """Math answer checking with math-verify: the last boxed/LaTeX/plain expression of the
    response (of its last <answer>...</answer> when present) against the gold answer, numeric
    and symbolic equality (1/2 == 0.5 == \\frac{1}{2}).
    math-verify times itself out with SIGALRM, which works in the main thread (the trainer's)."""
    from math_verify import parse, verify

    answer = str(answer).strip()
    # A bare gold answer (42, \sqrt{2}, x^2+1) parses as LaTeX only inside $...$.
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    tagged = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    pred = parse(tagged[-1] if tagged else response)  # math-verify does not look inside the tags
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))


_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")


@register("last_number")
def last_number(response: str, answer: str) -> float:
    """1 when the last number written in the response (an integer or decimal literal, thousands
    commas allowed) equals the numeric answer. No expression is evaluated: "73 + 98" ends with the
    number 98, so a response that restates the question does not earn the answer 171, which the
    symbolic ``math`` component would grant (math-verify simplifies 73 + 98 to 171). For tasks
    whose answer is a plain number (arithmetic, GSM8K)."""
    found = _NUMBER.findall(response)
    if not found:
        return 0.0
    try:
        return float(float(found[-1].replace(",", "")) == float(str(answer).strip().replace(",", "")))
    except ValueError:
        return 0.0


@register("format_boxed")
def format_boxed(response: str, answer: str) -> float:
    return float("\\boxed{" in response)


@register("format_answer_tag")
def format_answer_tag(response: str, answer: str) -> float:
    return float(re.search(r"<answer>.*?</answer>", response, re.DOTALL) is not None)


@register("verl", rows=True)
def verl(response: str, ground_truth, row) -> float | dict:
    """verl's rule-based scorer for the row's ``data_source``, with verl's value: 1/0 (gsm8k, MATH,
    PRIME), {"score": +-1, "acc", "pred"} (math_dapo, aime*), 0.9 x accuracy + 0.1 x format (geo3k);
    rlcore.task.verl_scores. A source verl has no scorer for is refused at start-up."""
    row = row if isinstance(row, dict) else {}
    return verl_scores.default_compute_score(row.get("data_source"), response, ground_truth, row.get("extra_info"))


# ----------------------------------------------------------------------------- scoring


class _ErrorLog:
    """Prints the first failure's traceback once per process; later ones are only counted."""

    printed = False

    @classmethod
    def report(cls, name: str, exc: BaseException, row=None) -> None:
        if cls.printed:
            return
        cls.printed = True
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        on = f" on the row {row_label(row)}" if row is not None else ""
        print(f"warning: reward {name} failed{on}; the sample gets reward.error_value and the run goes on "
              f"(further failures are only counted in reward/errors):\n{tb}", file=sys.stderr, flush=True)


def row_label(row) -> str:
    """How an error names a data row: verl's data_source and extra_info.index, else its prompt."""
    if not isinstance(row, dict):
        return repr(row)[:80]
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    named = [f"{k}={v!r}" for k, v in (("data_source", row.get("data_source")), ("extra_info.index", extra.get("index")))
             if v is not None]
    if named:
        return "(" + ", ".join(named) + ")"
    prompt = str(row.get("prompt", row))
    return f"with prompt {prompt[:60]!r}{'...' if len(prompt) > 60 else ''}"


def _as_value(value) -> tuple[float, bool | None]:
    """A component's value and its verdict: a number (verdict None: decided by the value), or a dict
    with ``score`` and optionally ``acc`` (verl's). Non-numbers and non-finite scores raise."""
    acc = None
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"the reward returned a dict without 'score': {sorted(value)}")
        acc = bool(value["acc"]) if "acc" in value else None
        value = value["score"]
    value = float(value)  # TypeError/ValueError for non-numbers: counted as an error
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return value, acc


def _label(name: str, fn) -> str:
    spec = getattr(fn, "spec", None)
    return f"{name!r} ({spec})" if spec else repr(name)


def _component_values(name: str, fn: Callable, samples: list[tuple], timeout_s: float | None, error_value: float,
                      num_turns) -> tuple[list[float], list[bool], list]:
    """One component's value per sample (response, ground truth, row), which samples failed, and
    each sample's verdict (None: decided by the value)."""
    rows = getattr(fn, "takes_rows", False)
    extra = {"num_turns": num_turns} if isinstance(fn, CustomReward) else {}
    if getattr(fn, "batched", False):
        responses, truths, data = (list(x) for x in zip(*samples)) if samples else ([], [], [])
        try:
            got = call_with_timeout(lambda: fn(responses, truths, *([data] if rows else [])), (), timeout_s)
            got = [_as_value(v) for v in got]
            if len(got) != len(samples):
                raise ValueError(f"batched reward returned {len(got)} values for {len(samples)} samples")
            return [v for v, _ in got], [False] * len(got), [a for _, a in got]
        except Exception as e:
            _ErrorLog.report(_label(name, fn), e)
            return [error_value] * len(samples), [True] * len(samples), [None] * len(samples)
    out = []  # (value, failed, verdict) per sample
    for response, truth, row in samples:
        try:
            args = (response, truth, row) if rows else (response, truth)
            value, acc = _as_value(call_with_timeout(lambda: fn(*args, **extra), (), timeout_s))
            out.append((value, False, acc))
        except Exception as e:
            _ErrorLog.report(_label(name, fn), e, row)
            out.append((error_value, True, None))
    values, failed, verdicts = (list(x) for x in zip(*out)) if out else ([], [], [])
    return values, failed, verdicts


def _samples(fn, responses: list[str], answers: list[str], rows: list | None, answer_key: str | None) -> list[tuple]:
    """(response, what the function compares with, row) per sample: a row-aware function gets the
    row's stored value at ``answer_key`` (verl's ground truth as it is), the others the answer text."""
    rows = rows if rows is not None else [None] * len(responses)
    if not getattr(fn, "takes_rows", False):
        return list(zip(responses, answers, rows))
    return [(r, _truth(row, answer, answer_key), row) for r, answer, row in zip(responses, answers, rows)]


def _truth(row, answer: str, answer_key: str | None):
    if answer_key and isinstance(row, dict):
        try:
            return get_key(row, answer_key)
        except KeyError:
            pass
    return answer


def score_samples(responses: list[str], answers: list[str], components: dict[str, float], *,
                  custom_fn: Callable | None = None, timeout_s: float | None = None,
                  error_value: float = 0.0, env_rewards: list | None = None,
                  judged: dict[str, tuple[list[float], list[bool], float]] | None = None,
                  rows: list | None = None, answer_key: str | None = None) -> tuple[list[float], list[bool], dict]:
    """Weighted sum of the components for each response, the per-sample "fully correct" flag
    (every component passed: its ``acc`` if it gave one, else a value >= 1), and metrics of these
    samples: ``reward/{name}`` component means, ``reward/accuracy`` and ``reward/errors`` (failed
    sample-component calls). The timeout applies to ``custom_fn``. The ``env`` component is each
    sample's environment reward (a multi-turn env.cls; None, when it gave none, counts 0). ``judged``:
    the values, parse failures and pass thresholds of model-based components (rlcore.judge), scored
    already. ``rows`` (the data rows) and ``answer_key`` feed row-aware components (``verl``, a
    verl-signature reward.fn)."""
    n = len(responses)
    totals, correct = [0.0] * n, [True] * n
    metrics, errors = {}, 0
    for name, weight in components.items():
        failed, pass_at, verdicts = [False] * n, 1.0 - 1e-6, [None] * n
        if name == ENV:
            values = [0.0 if r is None else float(r) for r in (env_rewards or [None] * n)]
        elif judged is not None and name in judged:
            values, failed, pass_at = judged[name]  # an unreadable verdict is never "correct", nor an error
        else:
            if name == CUSTOM:
                if custom_fn is None:
                    raise ValueError("the 'custom' reward component needs reward.fn")
                fn, limit = custom_fn, timeout_s
            else:
                fn, limit = get_reward(name), None
            values, failed, verdicts = _component_values(
                name, fn, _samples(fn, responses, answers, rows, answer_key), limit, error_value,
                SINGLE_TURN if env_rewards is None else None)
            errors += sum(failed)
        totals = [t + weight * v for t, v in zip(totals, values)]
        # A failed call is never "correct", whatever reward.error_value is.
        correct = [c and (v >= pass_at if a is None else a) and not f
                   for c, v, f, a in zip(correct, values, failed, verdicts)]
        metrics[f"reward/{name}"] = sum(values) / max(n, 1)
    metrics["reward/accuracy"] = sum(correct) / max(n, 1)
    metrics["reward/errors"] = float(errors)
    return totals, correct, metrics


class Scorer:
    """A RewardConfig made callable: ``Scorer(cfg).score(responses, answers)``. Model-based
    components (``reward.models``) score through ``judges`` (name -> rlcore.judge.scorer.Judge),
    attached once their engines are built, inside ``judging``: the phase switch's context that
    puts the policy's engine to sleep and wakes the judges (rlcore.step.switch). ``answer_key``
    (data.answer_key): where row-aware components read a row's ground truth as stored."""

    def __init__(self, cfg, components: dict[str, float] | None = None, answer_key: str | None = None):
        self.cfg, self.answer_key = cfg, answer_key
        self.components = dict(components) if components else cfg.effective_components()
        self.custom_fn = CustomReward(cfg.fn, getattr(cfg, "fn_kwargs", None)) if cfg.fn else None
        self.timeout_s, self.error_value = cfg.timeout_s, cfg.error_value
        self.judges: dict = {}
        self.judging = None  # (judges) -> context manager
        self.timer = None
        self.for_validation = self  # val.reward_components' scorer (rlcore.run.preflight.prepare_scoring)

    def attach_judges(self, judges: dict, judging, timer=None) -> None:
        self.judges, self.judging, self.timer = judges, judging, timer
        if self.for_validation is not self:
            self.for_validation.attach_judges(judges, judging, timer)

    def _judge(self, responses: list[str], answers: list[str], rows: list | None) -> tuple[dict, dict]:
        active = [self.judges[name] for name in self.components if name in self.judges]
        if not responses:
            return {j.name: ([], [], 1.0) for j in active}, {}
        if not active:
            return {}, {}
        judged, metrics = {}, {}
        with self.judging(active):  # the policy's engine sleeps, the judges are awake
            for judge in active:
                with self.timer("judge") if self.timer else contextlib.nullcontext():  # timing/judge_s
                    values, failed, m = judge.score(responses, answers, rows)
                judged[judge.name] = (values, failed, judge.cfg.pass_threshold - 1e-6)
                metrics.update(m)
        return judged, metrics

    def score_samples(self, responses: list[str], answers: list[str], env_rewards: list | None = None,
                      rows: list | None = None) -> tuple[list[float], list[bool], dict]:
        judged, judge_metrics = self._judge(responses, answers, rows)
        totals, correct, metrics = score_samples(
            responses, answers, self.components, custom_fn=self.custom_fn, timeout_s=self.timeout_s,
            error_value=self.error_value, env_rewards=env_rewards, judged=judged, rows=rows, answer_key=self.answer_key)
        return totals, correct, {**metrics, **judge_metrics}

    def score(self, responses: list[str], answers: list[str], env_rewards: list | None = None,
              rows: list | None = None) -> tuple[list[float], dict]:
        totals, _, metrics = self.score_samples(responses, answers, env_rewards, rows)
        return totals, metrics

    def judge_outputs(self) -> dict[str, list]:
        """Each judge's (raw output, score) per sample of the last scoring call (validation examples)."""
        return {name: list(zip(j.last_raw, j.last_values)) for name, j in self.judges.items()
                if name in self.components}
