"""Rule-based rewards and user reward functions.

Built-ins are ``fn(response: str, answer: str) -> float`` in a registry (``REWARDS``); a run's
reward is a weighted sum of named components (``reward.components``).

Custom reward (``reward.fn``): ``"package.module:function"`` (importable) or
``"path/to/file.py:function"`` (loaded from that file). It enters the sum as the component
``custom``. Two signatures are accepted:

    def my_reward(response: str, answer: str) -> float               # one sample per call
    @rlcore.task.rewards.batched                                          # or set my_reward.batched = True
    def my_reward(responses: list[str], answers: list[str]) -> list[float]   # one call per batch

Convention: a component scores in [0, 1], 1 meaning fully correct; ``reward/accuracy`` is the
fraction of samples whose every component scored >= 1.

A call that raises, returns a non-number, or runs past ``reward.timeout_s`` (custom functions
only) gives ``reward.error_value`` to its sample(s), counts in ``reward/errors``, prints the first
traceback of the process once, and the run goes on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import re
import signal
import sys
import threading
import traceback
from typing import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}
ENV = "env"  # the component that is a multi-turn environment's own reward (rlcore.agent)
CUSTOM = "custom"  # component name of reward.fn


def register(name: str):
    def wrap(fn: RewardFn) -> RewardFn:
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


# ----------------------------------------------------------------------------- custom functions


def load_custom_fn(spec: str) -> Callable:
    """Import ``module:function`` or ``file.py:function``; ValueError with the reason otherwise."""
    module_part, sep, func_name = spec.rpartition(":")
    if not sep or not module_part or not func_name:
        raise ValueError("write it as package.module:function or path/to/file.py:function")
    try:
        if module_part.endswith(".py") or os.sep in module_part:
            if not os.path.isfile(module_part):
                raise ValueError(f"file {module_part} does not exist")
            mod_spec = importlib.util.spec_from_file_location(f"_reward_{abs(hash(module_part))}", module_part)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_part)
    except ValueError:
        raise
    except Exception as e:  # ImportError, SyntaxError, anything the module raises at import
        raise ValueError(f"importing {module_part} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"{module_part} has no callable named {func_name!r}")
    return fn


class RewardTimeout(Exception):
    pass


def call_with_timeout(fn: Callable, args: tuple, timeout_s: float | None):
    """``fn(*args)``, raising RewardTimeout past ``timeout_s`` (None or <= 0: no limit).

    Main thread: SIGALRM via setitimer, which interrupts pure-Python code (a C call that never
    returns to the interpreter is interrupted when it does). Caveat: a function that sets its own
    alarm (math-verify does) cancels this one. Other threads: a daemon worker thread; a timed-out
    call keeps running there in the background but its result is discarded.
    """
    if not timeout_s or timeout_s <= 0:
        return fn(*args)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _call_with_alarm(fn, args, timeout_s)
    return _call_in_thread(fn, args, timeout_s)


def _call_with_alarm(fn, args, timeout_s):
    def on_alarm(signum, frame):
        raise RewardTimeout(f"exceeded reward.timeout_s={timeout_s}")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_in_thread(fn, args, timeout_s):
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout(f"exceeded reward.timeout_s={timeout_s}")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ----------------------------------------------------------------------------- scoring


class _ErrorLog:
    """Prints the first failure's traceback once per process; later ones are only counted."""

    printed = False

    @classmethod
    def report(cls, name: str, exc: BaseException) -> None:
        if cls.printed:
            return
        cls.printed = True
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(f"warning: reward {name!r} failed; the sample gets reward.error_value and the run goes on "
              f"(further failures are only counted in reward/errors):\n{tb}", file=sys.stderr, flush=True)


def _as_score(value) -> float:
    value = float(value)  # TypeError/ValueError for non-numbers: counted as an error
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return value


def _component_values(name: str, fn: Callable, responses: list[str], answers: list[str],
                      timeout_s: float | None, error_value: float) -> tuple[list[float], list[bool]]:
    """One component's score per sample, and which samples failed."""
    if getattr(fn, "batched", False):
        try:
            values = call_with_timeout(fn, (list(responses), list(answers)), timeout_s)
            values = [_as_score(v) for v in values]
            if len(values) != len(responses):
                raise ValueError(f"batched reward returned {len(values)} values for {len(responses)} samples")
            return values, [False] * len(values)
        except Exception as e:
            _ErrorLog.report(name, e)
            return [error_value] * len(responses), [True] * len(responses)
    values, failed = [], []
    for response, answer in zip(responses, answers):
        try:
            values.append(_as_score(call_with_timeout(fn, (response, answer), timeout_s)))
            failed.append(False)
        except Exception as e:
            _ErrorLog.report(name, e)
            values.append(error_value)
            failed.append(True)
    return values, failed


def score_samples(responses: list[str], answers: list[str], components: dict[str, float], *,
                  custom_fn: Callable | None = None, timeout_s: float | None = None,
                  error_value: float = 0.0, env_rewards: list | None = None,
                  judged: dict[str, tuple[list[float], list[bool], float]] | None = None) -> tuple[list[float], list[bool], dict]:
    """Weighted sum of the components for each response, the per-sample "fully correct" flag
    (every component >= 1), and metrics of these samples: ``reward/{name}`` component means,
    ``reward/accuracy`` and ``reward/errors`` (failed sample-component calls). The timeout
    applies to ``custom_fn``. The ``env`` component is each sample's environment reward (a
    multi-turn env.cls; None, when it gave none, counts 0). ``judged``: the values, parse
    failures and pass thresholds of model-based components (rlcore.judge), scored already."""
    n = len(responses)
    totals, correct = [0.0] * n, [True] * n
    metrics, errors = {}, 0
    for name, weight in components.items():
        failed, pass_at = [False] * n, 1.0 - 1e-6
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
            values, failed = _component_values(name, fn, responses, answers, limit, error_value)
            errors += sum(failed)
        totals = [t + weight * v for t, v in zip(totals, values)]
        # A failed call is never "correct", whatever reward.error_value is.
        correct = [c and v >= pass_at and not f for c, v, f in zip(correct, values, failed)]
        metrics[f"reward/{name}"] = sum(values) / max(n, 1)
    metrics["reward/accuracy"] = sum(correct) / max(n, 1)
    metrics["reward/errors"] = float(errors)
    return totals, correct, metrics


class Scorer:
    """A RewardConfig made callable: ``Scorer(cfg).score(responses, answers)``. Model-based
    components (``reward.models``) score through ``judges`` (name -> rlcore.judge.scorer.Judge),
    attached once their engines are built, inside ``judging``: the phase switch's context that
    puts the policy's engine to sleep and wakes the judges (rlcore.step.switch)."""

    def __init__(self, cfg, components: dict[str, float] | None = None):
        self.cfg = cfg
        self.components = dict(components) if components else cfg.effective_components()
        self.custom_fn = load_custom_fn(cfg.fn) if cfg.fn else None
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
            error_value=self.error_value, env_rewards=env_rewards, judged=judged)
        return totals, correct, {**metrics, **judge_metrics}

    def score(self, responses: list[str], answers: list[str], env_rewards: list | None = None,
              rows: list | None = None) -> tuple[list[float], dict]:
        totals, _, metrics = self.score_samples(responses, answers, env_rewards, rows)
        return totals, metrics

    def judge_outputs(self) -> dict[str, list]:
        """Each judge's (raw output, score) per sample of the last scoring call (validation examples)."""
        return {name: list(zip(j.last_raw, j.last_values)) for name, j in self.judges.items()
                if name in self.components}
