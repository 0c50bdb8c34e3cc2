"""The micro-batches of the no-gradient forwards: the old-policy and reference log-probs.

They keep no activations for a backward, so they can run larger micro-batches than the update
(verl's ``log_prob_micro_batch_size_per_gpu`` and ``log_prob_max_token_len_per_gpu``):
``algorithm.log_prob_micro_batch_size`` and ``algorithm.log_prob_micro_batch_tokens``, each null
for the update's value. The split itself is ``packing.split_micro``'s, given the config this
module returns, so a token budget packs and balances over the ranks the same way.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlcore.errors import check

if TYPE_CHECKING:  # annotations only
    from rlcore.algo.config import AlgorithmConfig


def log_prob_micro(cfg: AlgorithmConfig) -> AlgorithmConfig:
    """``cfg`` with its micro-batch keys replaced by the no-gradient forwards' own: the size
    (null: micro_batch_size) and the token budget (null: micro_batch_tokens). A token budget,
    either one, wins over the size, as it does for the update."""
    size = cfg.log_prob_micro_batch_size or cfg.micro_batch_size
    tokens = cfg.log_prob_micro_batch_tokens or cfg.micro_batch_tokens
    if size == cfg.micro_batch_size and tokens == cfg.micro_batch_tokens:
        return cfg
    return dataclasses.replace(cfg, micro_batch_size=size, micro_batch_tokens=tokens)


def describe_log_prob_micro(cfg: AlgorithmConfig) -> str:
    """The start-up words for the no-gradient micro-batches; "" when they are the update's."""
    lp = log_prob_micro(cfg)
    if lp is cfg:
        return ""
    what = (f"up to {lp.micro_batch_tokens} tokens" if lp.micro_batch_tokens
            else f"of {lp.micro_batch_size} sequences")
    return f", old/ref log-prob micro-batches {what}"


def check_log_prob_tokens(cfg: AlgorithmConfig, longest: int) -> None:
    """A no-gradient token budget below one sample would be exceeded by every micro-batch that
    holds that sample (the split never cuts a sequence): refuse it, as verl's dynamic batch size
    asserts max_token_len >= the longest sequence."""
    budget = cfg.log_prob_micro_batch_tokens
    check(budget is None or budget >= longest, "algorithm.log_prob_micro_batch_tokens", budget,
          f"it must hold the longest sequence, data.max_prompt_length + the longest response = {longest} tokens; "
          f"raise it to at least {longest}, or null for algorithm.micro_batch_tokens")
