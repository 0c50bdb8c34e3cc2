"""train_grpo.py with faults injected, for tests only (the production loop has no such hooks):

  RLCORE_TEST_NAN_STEPS=2,4   the last rank's advantages (so its loss) are NaN at those steps
  RLCORE_TEST_SIGNAL_STEP=N   the last rank sends itself SIGUSR1 during step N's generation phase
                              (a preemption that lands mid-step, deterministically)
  RLCORE_TEST_SKIP_SYNC_STEPS=2  the weight sync after those steps is skipped on every rank: vLLM
                              generates the next step with stale weights
  RLCORE_TEST_FILL=WHEN:N:BYTES  another job fills trainer.output_dir's filesystem at step N (rank 0
                              writes a filler file leaving BYTES free, then every rank goes on):
                              WHEN=before_check before the space check of that step's checkpoint,
                              after_check between the check and the checkpoint's write
  RLCORE_TEST_READONLY_AT_STEP=N  trainer.output_dir becomes read-only just before step N's metrics
                              row (rank 0 bind-mounts it read-only over itself; the test unmounts it)
  RLCORE_TEST_ADAPTER_ROOT_AT_STEP=N:PATH  LoRA: from the weight sync after step N on, the last rank
                              writes the adapter it pushes to vLLM under PATH (a read-only mount)
                              instead of /dev/shm: that rank's own local write fails

Run it in place of train_grpo.py (``torchrun ... tests/workers/faulty_train.py ARGS``).
"""

import os
import runpy
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from rlcore import metrics  # noqa: E402
from rlcore.algo import grpo  # noqa: E402
from rlcore.run import checkpoint, lifecycle  # noqa: E402
from rlcore.step import sampling, switch  # noqa: E402

NAN_STEPS = {int(s) for s in os.environ.get("RLCORE_TEST_NAN_STEPS", "").split(",") if s}
SIGNAL_STEP = int(os.environ.get("RLCORE_TEST_SIGNAL_STEP", "0") or 0)
SKIP_SYNC_STEPS = {int(s) for s in os.environ.get("RLCORE_TEST_SKIP_SYNC_STEPS", "").split(",") if s}
FILL = os.environ.get("RLCORE_TEST_FILL", "")
READONLY_AT_STEP = int(os.environ.get("RLCORE_TEST_READONLY_AT_STEP", "0") or 0)
ADAPTER_ROOT_AT_STEP = os.environ.get("RLCORE_TEST_ADAPTER_ROOT_AT_STEP", "")
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


def fill_filesystem(output_dir: str, left: int) -> None:
    """Rank 0 takes all but ``left`` bytes of the filesystem, then every rank goes on together."""
    import torch.distributed as dist

    if int(os.environ.get("RANK", "0")) == 0:
        st = os.statvfs(output_dir)
        size = st.f_bavail * st.f_frsize - left
        fd = os.open(os.path.join(output_dir, "filler.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.posix_fallocate(fd, 0, size)
        os.close(fd)
        print(f"test: filled {output_dir}'s filesystem, {left} bytes left", file=sys.stderr, flush=True)
    dist.barrier()


def filling(fn, when: str):
    """``fn`` (lifecycle.room or checkpoint.write: the step is the run's) with the fill first at its step."""
    fill_when, step, left = FILL.split(":")

    def wrapped(*args, **kwargs):
        if fill_when == when and current["step"] == int(step):
            fill_filesystem(args[0].cfg.trainer.output_dir if when == "before_check" else args[1], int(left))
        return fn(*args, **kwargs)
    return wrapped


_log = metrics.MetricsLogger.log


def log(self, step: int, row: dict):
    if step == READONLY_AT_STEP and self.is_main and "timing/step_s" in row:  # the training row
        import subprocess

        out = os.path.dirname(self.path)
        for cmd in (["mount", "--bind", out, out], ["mount", "-o", "remount,bind,ro", out]):
            subprocess.run(cmd, check=True)
        print(f"test: {out} is read-only from now on", file=sys.stderr, flush=True)
    return _log(self, step, row)


def adapter_dir_from(step: int, root: str):
    from rlcore.rollout import lora

    default = lora.adapter_dir

    def adapter_dir(given: str | None = None) -> str:
        late = current["step"] >= step and _last_rank()
        return default(root if late else given)
    lora.adapter_dir = adapter_dir


if ADAPTER_ROOT_AT_STEP:
    adapter_dir_from(int(ADAPTER_ROOT_AT_STEP.split(":", 1)[0]), ADAPTER_ROOT_AT_STEP.split(":", 1)[1])
if FILL:
    lifecycle.room = filling(lifecycle.room, "before_check")
    checkpoint.write = filling(checkpoint.write, "after_check")
if READONLY_AT_STEP:
    metrics.MetricsLogger.log = log
sampling.StepSampler.sample = sample
switch.PhaseSwitcher._sync_weights = _sync_weights
grpo.train_on_batch = train_on_batch
sys.argv = [os.path.join(REPO, "train_grpo.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
