"""train_grpo.py with faults injected, for tests only (the production loop has no such hooks):

  RLCORE_TEST_NAN_STEPS=2,4   the last rank's advantages (so its loss) are NaN at those steps
  RLCORE_TEST_SIGNAL_STEP=N   the last rank sends itself SIGUSR1 during step N's generation phase
                              (a preemption that lands mid-step, deterministically)
  RLCORE_TEST_SKIP_SYNC_STEPS=2  the weight sync after those steps is skipped on every rank: vLLM
                              generates the next step with stale weights

Run it in place of train_grpo.py (``torchrun ... tests/workers/faulty_train.py ARGS``).
"""

import os
import runpy
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from rlcore.algo import grpo  # noqa: E402
from rlcore.step import sampling, switch  # noqa: E402

NAN_STEPS = {int(s) for s in os.environ.get("RLCORE_TEST_NAN_STEPS", "").split(",") if s}
SIGNAL_STEP = int(os.environ.get("RLCORE_TEST_SIGNAL_STEP", "0") or 0)
SKIP_SYNC_STEPS = {int(s) for s in os.environ.get("RLCORE_TEST_SKIP_SYNC_STEPS", "").split(",") if s}
current = {"step": 0}


def _last_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1


_sample = sampling.StepSampler.sample


def sample(self, step: int):
    current["step"] = step
    out = _sample(self, step)
    if step == SIGNAL_STEP and _last_rank():
        os.kill(os.getpid(), signal.SIGUSR1)
    return out


_train = grpo.train_on_batch


def train_on_batch(policy, ref, batch, adv, *args, **kwargs):
    if current["step"] in NAN_STEPS and _last_rank():
        adv = adv * float("nan")
    return _train(policy, ref, batch, adv, *args, **kwargs)


_sync = switch.PhaseSwitcher._sync_weights


def _sync_weights(self) -> str:
    if current["step"] in SKIP_SYNC_STEPS:
        return "skipped (test: stale engine)"
    return _sync(self)


sampling.StepSampler.sample = sample
switch.PhaseSwitcher._sync_weights = _sync_weights
grpo.train_on_batch = train_on_batch
sys.argv = [os.path.join(REPO, "train_grpo.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
