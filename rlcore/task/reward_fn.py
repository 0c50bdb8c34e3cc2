"""``reward.fn``: the user's reward function, loaded and called in the signature it was written in.

Four signatures, told apart by the function's parameter names (``inspect.signature``):

    def my_reward(response, answer) -> float                                 # rlcore, one sample
    @rlcore.task.rewards.batched
    def my_reward(responses, answers) -> list[float]                         # rlcore, a batch
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)
        -> float | dict                                                      # verl, one sample
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)
        -> list[float | dict]                                                # verl, a batch

A function with a ``solution_str`` parameter is verl's ``custom_reward_function`` and is called as
verl's reward managers call it: keywords ``data_source`` (the row's), ``solution_str`` (the
response decoded without special tokens), ``ground_truth`` (the row's value at data.answer_key, as
stored: verl rows' ``reward_model.ground_truth``), ``extra_info`` (a copy of the row's, plus verl's
``num_turns`` and ``rollout_reward_scores``), then ``reward.fn_kwargs`` (verl's reward_kwargs, which
win over the others: verl/trainer/ppo/reward.py:31-37). verl/experimental/reward_loop/reward_manager/
naive.py:31-85 (one sample; ``async def`` functions too) and verl/workers/reward_manager/batch.py:
46-79 (a batch, with ``solution_strs``). It returns a number or a dict with ``score`` (its ``acc``,
when present, decides whether the sample counts as correct). reward.fn_kwargs reach the rlcore
signatures too, as keyword arguments.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
from typing import Callable

VERL_ONE = ("data_source", "solution_str", "ground_truth", "extra_info")  # naive.py:64-69
VERL_BATCH = ("data_sources", "solution_strs", "ground_truths", "extra_infos")  # batch.py:70-76
SINGLE_TURN = 2  # verl's num_turns of a prompt and its response (single_turn_agent_loop.py:99)


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


def signature_of(fn: Callable) -> str:
    """``verl`` / ``verl_batched`` (verl's parameter names), else ``batched`` / ``rlcore``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the rlcore call
        params = {}
    if VERL_BATCH[1] in params:
        return "verl_batched"
    if VERL_ONE[1] in params:
        return "verl"
    return "batched" if getattr(fn, "batched", False) else "rlcore"


class CustomReward:
    """reward.fn made callable the way the scorer calls components. ``takes_rows``: called with
    (response(s), ground truth(s), row(s)); ``batched``: once per batch."""

    def __init__(self, spec: str, kwargs: dict | None = None):
        self.spec, self.kwargs = spec, dict(kwargs or {})
        self.fn = load_custom_fn(spec)
        self.kind = signature_of(self.fn)
        self.takes_rows = self.kind.startswith("verl")
        self.batched = self.kind in ("verl_batched", "batched")
        self._check_call()

    def _check_call(self) -> None:
        """The call the scorer will make binds to the function's parameters (ValueError otherwise)."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        call = {"verl": dict(zip(VERL_ONE, (None, "", None, {}))),
                "verl_batched": dict(zip(VERL_BATCH, ([], [], [], [])))}.get(self.kind)
        try:
            if call is None:
                sig.bind("", "", **self.kwargs)
            else:
                sig.bind(**{**call, **self.kwargs})
        except TypeError as e:
            expected = {"verl": "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)",
                        "verl_batched": "compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)",
                        }.get(self.kind, "fn(response, answer) (or fn(responses, answers) with @batched)")
            kw = f" plus reward.fn_kwargs {sorted(self.kwargs)}" if self.kwargs else ""
            raise ValueError(f"it cannot be called as {expected}{kw} ({e}); fix its parameters or "
                             f"reward.fn_kwargs") from e

    def __call__(self, responses, truths, rows=None, num_turns=SINGLE_TURN):
        if self.kind == "rlcore" or self.kind == "batched":
            return self.fn(responses, truths, **self.kwargs)
        if self.kind == "verl":
            row = rows or {}
            return self._run(data_source=row.get("data_source"), solution_str=responses, ground_truth=truths,
                             extra_info={**(row.get("extra_info") or {}), "num_turns": num_turns,
                                         "rollout_reward_scores": {}})
        rows = rows or [{}] * len(responses)
        return self._run(data_sources=[(r or {}).get("data_source") for r in rows], solution_strs=list(responses),
                         ground_truths=list(truths),
                         extra_infos=[{**((r or {}).get("extra_info") or {}), "rollout_reward_scores": {}} for r in rows])

    def _run(self, **call):
        result = self.fn(**{**call, **self.kwargs})  # reward_kwargs win (verl/trainer/ppo/reward.py:31-37)
        return asyncio.run(result) if inspect.iscoroutine(result) else result
