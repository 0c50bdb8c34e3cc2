"""REINFORCE++ whitens advantages over the global batch: the same samples split over 2 gloo ranks
give the advantages of 1 rank holding them all (before, each replica whitened its own share, so
the advantages depended on the number of ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO  # noqa: F401  (puts the repository on sys.path)

N, T, GROUP = 8, 5, 4


def batch():
    from rlcore.algo.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, T + 1, (N,), generator=g).tolist()
    b = RolloutBatch(prompt_ids=[[1]] * N, response_ids=[[2] * n for n in lens], rollout_logp=[[0.0] * n for n in lens],
                     answers=["a"] * N, finish_reasons=["stop"] * N, group_size=GROUP)
    return b, torch.randn(N, generator=g)


def _worker(rank: int, world: int, port: int, estimator: str, out) -> None:
    from rlcore.algo.batch import advantages_for
    from rlcore.config import AlgorithmConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    b, scores = batch()
    per = N // world
    idx = list(range(rank * per, (rank + 1) * per))  # whole groups per rank
    adv = advantages_for(b.select(idx), scores[idx], AlgorithmConfig(adv_estimator=estimator, gamma=0.9))
    out[rank] = adv
    dist.destroy_process_group()


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_whitening_is_global(estimator):
    from rlcore.algo.batch import advantages_for
    from rlcore.config import AlgorithmConfig
    from rlcore.dist import _free_port

    b, scores = batch()
    full = advantages_for(b, scores, AlgorithmConfig(adv_estimator=estimator, gamma=0.9))  # one process
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(2, _free_port(), estimator, out), nprocs=2, join=True)
        split = torch.cat([out[0], out[1]])
    t = min(full.shape[1], split.shape[1])
    assert torch.allclose(split[:, :t], full[:, :t], atol=1e-6), (split - full[:, :t]).abs().max()
    # and a per-replica whitening really differs here (the test would catch a regression)
    half = advantages_for(b.select(list(range(N // 2))), scores[: N // 2], AlgorithmConfig(adv_estimator=estimator, gamma=0.9))
    assert not torch.allclose(half, full[: N // 2, : half.shape[1]], atol=1e-3)
