"""Validation with the colocated engine: greedy pass@1 on a prompt set, plus mean@n / pass@n of n
sampled answers when n > 1. Every rank takes part: each data-parallel replica generates for its
strided slice of the prompts, and the sums are all-reduced (TP ranks of one replica hold the same
outputs, so only TP rank 0 of each replica contributes).

Rows that carry a ``data_source`` (verl's rows) are also counted per source, as verl's
process_validation_metrics groups them (verl/trainer/ppo/metric_utils.py:896-1046): the same
metrics under ``val/{data_source}/`` (``val/openai/gsm8k/reward_mean`` is verl's
``val-core/openai/gsm8k/reward/mean@1``; docs/from_verl.md maps the names).

Used by train_grpo.py (``trainer.val_every``, ``trainer.val_before_train``) and by
scripts/evaluate.py, so a trained model is scored the same way in both places.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

from rlcore.dist import all_gather_objects, all_reduce_sum
from rlcore.errors import require_folder, writing
from rlcore.task.images import prompt_images


@dataclass
class ValSettings:
    n: int = 1  # > 1: n samples per prompt at `temperature` -> mean@n, pass@n
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    max_samples: int = 0  # first prompts used; 0 = all
    num_examples: int = 8  # greedy generations of the first prompts, kept for the JSONL file
    seed: int = 0  # of the sampled (n > 1) pass


@dataclass
class _Scored:
    texts: list[str]
    lens: list[int]
    rewards: list[float]
    correct: list[bool]
    errors: float
    conversations: list[str] | None = None  # multi-turn: the whole decoded conversation of each sample
    tool_calls: list[int] | None = None
    judged: dict | None = None  # reward.models: name -> each sample's (raw judge output, parsed score)


def _generate_and_score(rollout, tokenizer, scorer, prompts, agent=None, wake=None, **gen) -> tuple[list[list], _Scored]:
    """Generate for ``prompts`` (flattened prompt-major: n per prompt) and score every sample.
    ``wake``: called first (the phase switch's ensure_generation: a judge's scoring put the engine to sleep)."""
    if wake is not None:
        wake()
    if agent is not None:
        return None, _converse_and_score(agent, rollout, tokenizer, scorer, prompts, **gen)
    images = prompt_images(prompts)
    out = rollout.generate([p.ids for p in prompts], **gen, **({"images": images} if images else {}))
    samples = [s for group in out for s in group]
    answers = [p.answer for p, group in zip(prompts, out) for _ in group]
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    rows = [p.row for p, group in zip(prompts, out) for _ in group]
    rewards, correct, metrics = scorer.score_samples(texts, answers, rows=rows) if texts else ([], [], {})
    return out, _Scored(texts, [len(s.response_ids) for s in samples], rewards, correct,
                        metrics.get("reward/errors", 0.0), judged=scorer.judge_outputs() if texts else None)


def _converse_and_score(agent, rollout, tokenizer, scorer, prompts, *, n: int, temperature: float,
                        max_tokens: int, top_p: float = 1.0, seed: int | None = None) -> _Scored:
    """Multi-turn validation: the rule rewards read each conversation's final model turn."""
    groups = agent.run(rollout, [p.ids for p in prompts], [p.row for p in prompts], n=n, seed=seed or 0,
                       sampling={"temperature": temperature, "top_p": top_p}, per_turn_tokens=max_tokens)
    convs = [c for g in groups for c in g]
    answers = [p.answer for p in prompts for _ in range(n)]
    texts = tokenizer.batch_decode([c.final_text_ids() for c in convs], skip_special_tokens=True)
    rows = [p.row for p in prompts for _ in range(n)]
    rewards, correct, metrics = (scorer.score_samples(texts, answers, [c.env_reward for c in convs], rows=rows)
                                 if texts else ([], [], {}))
    failed = [getattr(c, "failed", False) for c in convs]  # an agent episode that failed scores 0
    rewards, correct = [0.0 if f else r for f, r in zip(failed, rewards)], [c and not f for f, c in zip(failed, correct)]
    return _Scored(texts, [sum(c.env_mask) for c in convs], rewards, correct, metrics.get("reward/errors", 0.0),
                   [tokenizer.decode(c.response_ids, skip_special_tokens=False) for c in convs],
                   [c.tool_calls for c in convs], judged=scorer.judge_outputs() if texts else None)


def validate(rollout, tokenizer, scorer, prompts: list, settings: ValSettings, agent=None,
             wake=None) -> tuple[dict, list[dict]]:
    """Returns (``val/*`` metrics over all ranks, the greedy rows of the first
    ``num_examples`` prompts), the same on every rank (collective). ``agent``: multi-turn, tools on.
    ``wake``: called before each generate (rlcore.step.switch.PhaseSwitcher.ensure_generation with judges)."""
    chosen = prompts[: settings.max_samples] if settings.max_samples else prompts
    mine = chosen[rollout.dp_rank:: rollout.dp_size]
    counts = 1.0 if rollout.tp_rank == 0 else 0.0  # count each replica's outputs once
    _, greedy = _generate_and_score(rollout, tokenizer, scorer, mine, agent, wake, n=1, temperature=0.0,
                                    max_tokens=settings.max_tokens)
    local = [len(mine), sum(greedy.correct), sum(greedy.rewards), sum(greedy.lens), greedy.errors]
    sampled = None
    if settings.n > 1:
        _, sampled = _generate_and_score(rollout, tokenizer, scorer, mine, agent, wake, n=settings.n,
                                         temperature=settings.temperature, top_p=settings.top_p,
                                         max_tokens=settings.max_tokens, seed=settings.seed)
        per_prompt = [sampled.correct[i * settings.n: (i + 1) * settings.n] for i in range(len(mine))]
        local += [sum(sampled.correct), sum(sampled.rewards), sum(any(c) for c in per_prompt), sampled.errors]
    if agent is not None:
        local.append(float(sum(greedy.tool_calls)))
    totals = all_reduce_sum([v * counts for v in local])
    metrics = _metrics(totals, settings.n)
    if agent is not None:
        metrics["val/tool_calls_mean"] = totals[-1] / max(totals[0], 1.0)
    metrics.update(_source_metrics(sources(chosen), mine, greedy, sampled, settings.n, counts))
    return metrics, _first_examples(rollout, mine, greedy, settings.num_examples)


def _source(prompt) -> str | None:
    source = (prompt.row or {}).get("data_source")
    return source if isinstance(source, str) and source else None


def sources(prompts: list) -> list[str]:
    """The data sources of a prompt set, sorted (every rank holds the whole set: the same list)."""
    return sorted({s for s in map(_source, prompts) if s is not None})


def _source_metrics(names: list[str], mine: list, greedy: _Scored, sampled: _Scored | None, n: int,
                    counts: float) -> dict:
    """The validation metrics of each data source's prompts (one all-reduce; nothing without sources)."""
    if not names:
        return {}
    width = 3 + (3 if sampled is not None else 0)
    per = {name: [0.0] * width for name in names}  # prompts, greedy correct, greedy reward[, sampled sums]
    for i, p in enumerate(mine):
        if _source(p) is None:
            continue
        sums = [1, greedy.correct[i], greedy.rewards[i]]
        if sampled is not None:
            right, rewards = sampled.correct[i * n: (i + 1) * n], sampled.rewards[i * n: (i + 1) * n]
            sums += [sum(right), sum(rewards), any(right)]
        per[_source(p)] = [a + float(b) for a, b in zip(per[_source(p)], sums)]
    local = [v for name in names for v in per[name]]
    totals = all_reduce_sum([v * counts for v in local])
    out = {}
    for k, name in enumerate(names):
        t, count = totals[width * k: width * (k + 1)], max(totals[width * k], 1.0)
        out.update({f"val/{name}/accuracy": t[1] / count, f"val/{name}/reward_mean": t[2] / count,
                    f"val/{name}/num_prompts": t[0]})
        if sampled is not None:
            out.update({f"val/{name}/mean@{n}": t[3] / (count * n), f"val/{name}/reward_mean@{n}": t[4] / (count * n),
                        f"val/{name}/pass@{n}": t[5] / count})
    return out


def _first_examples(rollout, mine: list, greedy: _Scored, k: int) -> list[dict]:
    """The rows of prompts 0..k-1 of the set, collected from the replicas that generated them
    (replica d holds prompts d, d + dp, ...: its first k rows cover its share of the first k)."""
    rows = [
        {"index": rollout.dp_rank + i * rollout.dp_size, "prompt": p.text, "response": t, "answer": p.answer,
         "reward": r, "correct": bool(c), "response_len": ln, **({"data_source": _source(p)} if _source(p) else {})}
        for i, (p, t, r, c, ln) in enumerate(zip(mine, greedy.texts, greedy.rewards, greedy.correct, greedy.lens))
    ][:k] if rollout.tp_rank == 0 else []  # TP ranks of a replica hold the same rows
    if greedy.conversations is not None:  # multi-turn: the whole conversation, tool messages included
        for row, conv, calls in zip(rows, greedy.conversations, greedy.tool_calls):
            row.update(conversation=conv, tool_calls=calls)
    for name, outputs in (greedy.judged or {}).items():  # the judge's own words next to its score
        for row, (raw, score) in zip(rows, outputs):
            row.update({f"judge_{name}_output": raw, f"judge_{name}_score": score})
    return sorted((r for part in all_gather_objects(rows) for r in part), key=lambda r: r["index"])[:k]


def _metrics(totals: list[float], n: int) -> dict:
    count = max(totals[0], 1.0)
    m = {
        "val/accuracy": totals[1] / count,  # greedy pass@1
        "val/reward_mean": totals[2] / count,
        "val/response_len_mean": totals[3] / count,
        "val/errors": totals[4],
        "val/num_prompts": totals[0],
    }
    if n > 1:
        m[f"val/mean@{n}"] = totals[5] / (count * n)
        m[f"val/reward_mean@{n}"] = totals[6] / (count * n)
        m[f"val/pass@{n}"] = totals[7] / count
        m["val/errors"] += totals[8]
    return m


def write_examples(output_dir: str, step: int, examples: list[dict]) -> str:
    """``output_dir/val/step_{step}.jsonl``: one generation per line; written aside and renamed,
    so a failed write (rlcore.errors.writing) leaves no partial file."""
    folder = os.path.join(output_dir, "val")
    path = os.path.join(folder, f"step_{step}.jsonl")
    tmp = os.path.join(folder, f".tmp-step_{step}.jsonl")
    with writing(f"the validation samples of step {step}", path):
        require_folder(output_dir)
        os.makedirs(folder, exist_ok=True)
        try:
            with open(tmp, "w") as f:
                for row in examples:
                    f.write(json.dumps({"step": step, **row}) + "\n")
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    return path
