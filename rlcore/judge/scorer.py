"""A judge as a reward component: render each sample for the judge, score the distinct ones in one
batched engine call, parse, map to the component's value.

Per rank, on the rank's own samples (a TP group's ranks hold the same samples and run the same
call); the values join the rule components' weighted sum, so DAPO filtering, advantages and
validation see them like any reward.
"""

from __future__ import annotations

import time

from rlcore.judge.config import JudgeConfig
from rlcore.judge.prompts import Template, compile_parser, prompt_text, to_score


class Judge:
    """``score(responses, answers, rows)`` -> (values, parse_failed, metrics); ``last_raw`` keeps each
    sample's raw judge output (generative: its text; discriminative: the head's value)."""

    def __init__(self, cfg: JudgeConfig, engine, prompt_key: str, seed: int = 0):
        from transformers import AutoTokenizer

        self.cfg, self.engine, self.prompt_key, self.seed = cfg, engine, prompt_key, seed
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        self.template = Template(cfg.template) if cfg.template else None
        self.parse = compile_parser(cfg.parser) if cfg.generative else None
        self.calls = 0  # scoring calls so far: the sampling seed of a judge with temperature > 0
        self.last_raw: list = []
        self.last_values: list[float] = []

    @property
    def name(self) -> str:
        return self.cfg.name

    def judge_ids(self, response: str, answer: str, row: dict | None) -> list[int]:
        """The token ids the judge reads for one sample."""
        row = row or {}
        fields = {**row, "prompt": prompt_text(row, self.prompt_key) if row else "", "response": response,
                  "answer": answer}
        tok, chat = self.tokenizer, getattr(self.tokenizer, "chat_template", None)
        if self.template is not None:
            text = self.template.render(fields)
            if self.cfg.generative and self.cfg.chat_template and chat:
                text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
                return tok(text, add_special_tokens=False)["input_ids"]
            return tok(text)["input_ids"]
        if chat:  # a reward model's own format: the conversation it was trained on
            text = tok.apply_chat_template([*self.conversation(row, fields["prompt"]),
                                            {"role": "assistant", "content": response}], tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(fields["prompt"] + response)["input_ids"]

    def conversation(self, row: dict, prompt: str) -> list[dict]:
        """The turns before the response a reward model reads: the row's prompt when it is chat
        messages (a system turn included, as verl's reward model reads its raw_prompt:
        verl/experimental/reward_loop/reward_loop.py:196-221), else one user turn of its text."""
        from rlcore.task.prompts import get_key

        try:
            messages = get_key(row, self.prompt_key)
        except KeyError:
            messages = None
        if isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages):
            return [{"role": m["role"], "content": m.get("content", "")} for m in messages]
        return [{"role": "user", "content": prompt}]

    def score(self, responses: list[str], answers: list[str], rows: list | None
              ) -> tuple[list[float], list[bool], dict]:
        c = self.cfg
        rows = rows if rows is not None else [None] * len(responses)
        inputs = [self._inputs(r, a, row) for r, a, row in zip(responses, answers, rows)]
        budget = c.max_model_len - (c.max_tokens if c.generative else 0)
        # One engine request per distinct judge input; an empty or over-long one is unscorable.
        distinct = list(dict.fromkeys(tuple(ids) for ids in inputs if 0 < len(ids) <= budget))
        start = time.perf_counter()
        raw, tokens = self._run([list(ids) for ids in distinct])
        seconds = time.perf_counter() - start
        by_input = dict(zip(distinct, raw))
        values, failed, self.last_raw = [], [], []
        for ids in inputs:
            out = by_input.get(tuple(ids))  # None: over the judge's context
            value = self._value(out)
            failed.append(value is None)
            values.append(c.parse_fail_value if value is None else value)
            self.last_raw.append(out)
        n = max(len(inputs), 1)
        metrics = {f"reward/{c.name}_parse_fail_frac": sum(failed) / n,
                   f"reward/{c.name}_overlong_frac": sum(len(ids) > budget for ids in inputs) / n,
                   f"judge/{c.name}_distinct_frac": len(distinct) / n,
                   f"perf/judge_{c.name}_tokens_per_s": tokens / max(seconds, 1e-9)}
        self.last_values = values
        return values, failed, metrics

    def _inputs(self, response: str, answer: str, row: dict | None) -> list[int]:
        """judge_ids, or [] (unscorable: scored parse_fail_value) when the template fails on this sample."""
        try:
            return self.judge_ids(response, answer, row)
        except Exception as e:  # e.g. a Jinja expression that fails on one row: the run goes on
            from rlcore.task.rewards import _ErrorLog

            _ErrorLog.report(f"{self.name} (its template)", e)
            return []

    def _run(self, inputs: list[list[int]]) -> tuple[list, int]:
        """Raw outputs (decoded answers or head values) and the tokens the engine processed."""
        if not inputs:
            return [], 0
        prompt_tokens = sum(len(ids) for ids in inputs)
        if not self.cfg.generative:
            return self.engine.classify(inputs), prompt_tokens
        self.calls += 1
        answers = self.engine.generate(inputs, seed=self.seed + self.calls)
        texts = self.tokenizer.batch_decode(answers, skip_special_tokens=True)
        return texts, prompt_tokens + sum(len(a) for a in answers)

    def _value(self, out) -> float | None:
        if out is None:
            return None
        if not self.cfg.generative:
            return to_score(out, self.cfg.score_range)
        from rlcore.task.rewards import call_with_timeout

        try:
            parsed = call_with_timeout(self.parse, (out,), self.cfg.timeout_s)
        except Exception:  # a parser that raises or times out: the answer is unreadable
            return None
        return to_score(parsed, self.cfg.score_range)
