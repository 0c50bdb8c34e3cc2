"""When the run's storage fails: the ranks agree on a failed write and end together with one
message; the space checks before the work.

A write that fails (``rlcore.errors.writing``: disk full, over quota, read-only, gone, I/O error)
inside a ``section`` is recorded on the rank that made it, which carries on through the section's
collectives (rank 0 writing ``latest`` while the others wait, rank 0 streaming an HF export while
every rank gathers, DCP's save, whose own protocol already reports a rank's failure to all). At the
next agreement point (``agree``: where a save's barriers were, at the end of each section, after
each step's metrics row, before each checkpoint) every rank learns every rank's failures and
raises ``StorageFailed``; the run then ends with one message (``message``: what failed, what is
intact, the command to resume) and ``Exit.STORAGE`` on every rank (``rlcore.run.lifecycle``).
Library threads that write (DCP's, TensorBoard's) are watched too (``thread_failures``).

Checked before the work (``check_output_dir`` at start-up, before any model loads; ``room_for``
before each checkpoint): the free space of ``trainer.output_dir`` against one checkpoint (the
last one's size, or at start-up the memory plan's trainer state: fp32 weights and the optimizer's
bytes per trainable parameter) plus the HF export when one is due.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import threading
from contextlib import contextmanager

from rlcore import errors
from rlcore.dist import all_gather_objects, all_reduce_sum
from rlcore.errors import ConfigError, describe_errno

DEBUG_ENV = "RLCORE_DEBUG"  # =1: a storage failure also prints the traceback of each failed write on its rank


class StorageFailed(Exception):
    """Raised on every rank together, once the ranks agreed: ``failures`` (every rank's failed
    writes, as ``failure_record`` dicts) or ``low_space`` (the check before a checkpoint)."""

    def __init__(self, failures: list[dict], low_space: dict | None = None):
        super().__init__(failures, low_space)
        self.failures, self.low_space = failures, low_space


_failed = [False]  # this process ended on a storage failure: nothing more is written (stop signals included)


def failed() -> bool:
    """A write failed on this rank (not agreed yet) or the run is ending on a storage failure."""
    return _failed[0] or bool(errors.pending())


def mark_failed() -> None:
    _failed[0] = True


def failure_record(err: errors.StorageError, rank: int) -> dict:
    """What every rank learns of one failed write (plain data: it crosses ranks). Another rank's
    failure that reached this one (DCP's) keeps that rank's number and is marked a copy: the rank
    it happened on reports it too, with its host."""
    copy = err.rank is not None and err.rank != rank
    return {"rank": err.rank if copy else rank, "host": None if copy else socket.gethostname(), "what": err.what,
            "path": err.path, "errno": err.errno, "strerror": err.strerror}


def distinct(failures: list[dict]) -> list[dict]:
    """The failures without the copies (DCP's) of one that its own rank reported too."""
    own = {(f["rank"], f["path"], f["errno"]) for f in failures if f["host"] is not None}
    return [f for f in failures if f["host"] is not None or (f["rank"], f["path"], f["errno"]) not in own]


# ----------------------------------------------------------------------------- agreement


@contextmanager
def section():
    """Writes inside are recorded when they fail, not raised (the rank goes on through the
    section's collectives); the section ends with ``agree``. Another exception ends it without
    the agreement (a collective then would not match the other ranks')."""
    with errors.deferred():
        yield
    agree()


def agree(note: dict | None = None) -> dict | None:
    """Collective, at an agreement point: raises ``StorageFailed`` on every rank when any rank has
    recorded a failed write. ``note``: rank 0's measurement for the others (``room_for``), returned
    on every rank. One all-reduce of two flags; the failures themselves cross only when there are."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    flags = all_reduce_sum([float(len(errors.pending()) > 0), float(note is not None)])
    if flags == [0.0, 0.0]:
        return None
    records = [failure_record(e, rank) for e in errors.pending()]
    parts = all_gather_objects((records, note))
    failures = distinct([r for recs, _ in parts for r in recs])
    note = parts[0][1]
    if failures:
        mark_failed()
        raise StorageFailed(failures)
    return note


@contextmanager
def thread_failures(what: str, path: str):
    """Writes on threads a library starts, which die on a failed write with a traceback that
    ``threading.excepthook`` prints: TensorBoard's event writer (it raises the error again on the
    next write), and DCP's writer threads (VeOmni asks for 16), whose save then goes on without
    that file's items (torch 2.13 distributed/checkpoint/filesystem.py:708-756 joins the threads
    and reads only the results they queued), so a checkpoint could look whole and lack them. Here
    such a failure is recorded like this thread's own (the next agreement stops every rank),
    without the traceback unless RLCORE_DEBUG=1."""
    previous = threading.excepthook

    def hook(args) -> None:
        exc = args.exc_value
        err = errors.as_storage_error(exc, _on_thread(what, exc), path) if exc is not None else None
        if err is None or debug():
            previous(args)
        if err is not None:
            errors.record(err)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


_WRITERS = (("tensorboard", "TensorBoard's event writer"), ("distributed/checkpoint", "DCP's shard writer"),
            ("wandb", "wandb's writer"), ("mlflow", "MLflow's writer"))


def _on_thread(what: str, exc: BaseException) -> str:
    """``what``, naming whose thread raised ``exc`` (from the files of its traceback)."""
    import traceback

    files = " ".join(frame.filename for frame in traceback.extract_tb(exc.__traceback__))
    writer = next((name for key, name in _WRITERS if key in files), "a library's writer") + " thread"
    return f"{what[:-1]}; {writer})" if what.endswith(")") else f"{what} ({writer})"


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def print_tracebacks() -> None:
    """With RLCORE_DEBUG=1: the traceback of each failed write on this rank."""
    if debug():
        import traceback

        for err in errors.pending():
            traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)


# ----------------------------------------------------------------------------- sizes and space


def free_bytes(path: str) -> tuple[int, str]:
    """(bytes available to this user, the mount point) of the filesystem ``path`` is (or would be) on."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize, _mount_point(probe)


def _mount_point(path: str) -> str:
    """The mount ``path`` is on: the longest mount point above it (/proc/self/mounts, which also
    knows bind mounts), else the nearest folder ``os.path.ismount`` accepts."""
    path = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            points = [line.split()[1].replace("\\040", " ") for line in f if len(line.split()) > 1]
        above = [p for p in points if path == p or path.startswith(p.rstrip("/") + "/")]
        if above:
            return max(above, key=len)
    except OSError:
        pass
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def folder_bytes(path: str) -> int:
    """Bytes of every file under ``path`` (0 when it does not exist)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


# Beside the tensors, a rank's share of a checkpoint: VeOmni's writer makes 16 DCP files a rank (a
# torch.save zip each, ~8 KiB of headers and records), its RNG file (17 KiB) and extra state, its
# part of .metadata. Measured on the tiny Qwen3 (2 ranks, 25 tensors, AdamW): 384,431 bytes beyond
# the tensors' 3,628,032 (tests/test_storage.py prints both); on a real model it is noise.
RANK_FILES_BYTES = 256 * 1024


def estimate_bytes(cfg, world: int) -> tuple[int, int, str]:
    """(one checkpoint, one HF export, how) in bytes, from the model's shape as the memory plan
    counts it (rlcore.plan): the trainer state on disk is the plan's checkpoint phase summed over
    the shard group, fp32 weights (4 bytes per parameter; LoRA: the adapters only, DCP saves
    trainable_only) and the optimizer's bytes per trainable parameter (OPTIMIZER_BYTES), plus
    RANK_FILES_BYTES a rank (its DCP files' headers, its RNG and extra-state files); the HF export
    is checkpoint.hf_dtype's bytes per parameter (LoRA: the adapter, plus the merged model with
    checkpoint.merge_lora), plus the model folder's other files (tokenizer, config)."""
    from rlcore.plan.inputs import DTYPE_BYTES, PlanInputs
    from rlcore.plan.memory import optimizer_bytes
    from rlcore.plan.model_shape import ModelShape

    o, lora = cfg.optim, cfg.lora.rank if cfg.lora.enabled else 0
    per_param = optimizer_bytes(o.optimizer, o.state_dtype, o.kahan_summation)
    try:
        p = PlanInputs(shape=ModelShape.from_path(cfg.model.path), world=1, device_gb=0.0, lora_rank=lora,
                       freeze_vision=cfg.model.freeze_vision_tower, optimizer_bytes=per_param)
        params, trainable = p.shape.params, p.trainable
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a config.json the plan cannot read
        params = trainable = safetensors_params(cfg.model.path)  # full fine-tuning's count: an upper bound
    saved = trainable if lora else params
    ckpt = 4 * saved + per_param * trainable + RANK_FILES_BYTES * world
    export_params = trainable + (params if cfg.checkpoint.merge_lora else 0) if lora else params
    aux = sum(os.path.getsize(os.path.join(cfg.model.path, f)) for f in os.listdir(cfg.model.path)
              if os.path.isfile(os.path.join(cfg.model.path, f)) and not f.endswith((".safetensors", ".bin", ".pt")))
    hf = DTYPE_BYTES[cfg.checkpoint.hf_dtype] * export_params + aux
    how = (f"{saved:,} parameters x 4 bytes (fp32) + {trainable:,} trainable x {per_param} bytes of "
           f"{o.optimizer} state + {world} ranks' file headers")
    return ckpt, hf, how


def safetensors_params(model_path: str) -> int:
    """Elements of every tensor in the folder's safetensors files (read from their headers)."""
    import json
    import math

    total = 0
    for name in os.listdir(model_path):
        if name.endswith(".safetensors"):
            with open(os.path.join(model_path, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def check_output_dir(cfg, rank: int, world: int) -> None:
    """Start-up, every rank, collective, before any model loads: ``trainer.output_dir`` (already
    claimed, so writable) has room for one checkpoint and the HF export when one is due; else
    ConfigError naming the space needed and found. A warning when it cannot hold checkpoint.keep_last
    of them at once plus the one being written."""
    problem = warning = None
    if rank == 0:
        try:
            problem, warning = _space_problem(cfg, world)
        except (OSError, ValueError, KeyError) as e:  # rank 0 alone must not leave the gather below
            warning = f"the free space of trainer.output_dir was not checked ({type(e).__name__}: {e})"
    problem, warning = all_gather_objects((problem, warning))[0]
    if warning and rank == 0:
        print(f"warning: {warning}", flush=True)
    if problem:
        raise ConfigError(problem)


def _space_problem(cfg, world: int) -> tuple[str | None, str | None]:
    c, out = cfg.checkpoint, cfg.trainer.output_dir
    ckpt, hf, how = estimate_bytes(cfg, world)
    ckpt = 0 if c.save_every == -1 else ckpt
    hf = hf if (c.hf_every or c.save_hf_final) else 0
    free, mount = free_bytes(out)
    if ckpt + hf == 0:
        return None, None
    parts = ([f"a checkpoint needs about {mb(ckpt)} ({how})"] if ckpt else []) + \
        ([f"an HF export {mb(hf)}"] if hf else [])
    if free < ckpt + hf:
        return (f"trainer.output_dir={out!r} has {mb(free)} free (filesystem {mount}), too little for this run: "
                f"{' and '.join(parts)}, {mb(ckpt + hf)} in all. Free space there, or point trainer.output_dir to a "
                f"filesystem with room", None)
    kept = (c.keep_last + 1) * ckpt + hf  # the kept ones and the one being written, before the oldest goes
    if free < kept:
        return None, (f"trainer.output_dir={out!r} has {mb(free)} free (filesystem {mount}): room for this run's "
                      f"next checkpoint ({mb(ckpt)}) but not for checkpoint.keep_last={c.keep_last} of them plus "
                      f"the one being written ({mb(kept)}); the run stops (or skips, checkpoint.on_low_space) "
                      f"when a checkpoint no longer fits")
    return None, None


def room_for(output_dir: str, need: int, what: str, is_main: bool) -> dict | None:
    """Collective, before a checkpoint or export: also an agreement point. Rank 0 measures the
    free space; returns the shortfall note ({need, free, mount, what}) on every rank, or None when
    ``need`` bytes fit."""
    note = None
    if is_main:
        free, mount = free_bytes(output_dir)
        if free < need:
            note = {"need": need, "free": free, "mount": mount, "what": what}
    return agree(note)


# ----------------------------------------------------------------------------- the message


def last_whole_row(output_dir: str) -> int | None:
    """Step of the last metrics.jsonl row that is whole (ends its line and parses), None if none."""
    import json

    path = os.path.join(output_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            lines = f.read().split(b"\n")[:-1]  # the part after the last newline is not a whole row
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def resume_commands(argv: list[str], output_dir: str, intact: str | None, nproc: int, nnodes: int) -> list[str]:
    """The command that resumes in ``output_dir`` (checkpoint.resume=auto), and one that resumes
    on another filesystem from the intact checkpoint; ``argv``: train_grpo.py's arguments."""
    keep, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] in ("--checkpoint.resume", "--trainer.output_dir"):
            skip = "=" not in arg
            continue
        keep.append(arg)
    launcher = f"torchrun --nproc_per_node={nproc}" + (f" --nnodes={nnodes} ..." if nnodes > 1 else "")
    base = f"{launcher} train_grpo.py {shlex.join(keep)}".rstrip()
    out = [f"{base} {shlex.join(['--trainer.output_dir', output_dir, '--checkpoint.resume', 'auto'])}"]
    if intact:
        out.append(f"{base} --trainer.output_dir NEW_DIR {shlex.join(['--checkpoint.resume', intact])}")
    return out


def message(failed: StorageFailed, step: int, output_dir: str, intact: str | None, cleanup: list[str],
            commands: list[str]) -> str:
    """The one message of a run that ends on its storage: what failed, what is intact, what to do."""
    if failed.low_space:
        n = failed.low_space
        head = (f"error: not enough space for {n['what']} at step {step}: it needs about {mb(n['need'])} (the last "
                f"checkpoint's size), {mb(n['free'])} is free on {n['mount']}; nothing of it was written")
    else:
        head = f"error: the run's storage failed at step {step}:"
        seen, what_of = {}, {}
        for f in failed.failures:  # one line per file and error (the first writer that met it), with the ranks
            key = (f["path"], f["errno"], f["host"] or "another host")
            what_of.setdefault(key, f["what"])
            seen.setdefault(key, []).append(f["rank"])
        for (path, code, host), ranks in seen.items():
            what = what_of[(path, code, host)]
            ranks = sorted(set(ranks))
            head += (f"\n  writing {what} failed: {path}: {describe_errno(code)}; rank{'s' * (len(ranks) > 1)} "
                     f"{', '.join(map(str, ranks))} on {host}")
    # Where to make room or grant write access: the output folder, or the folders outside it that failed
    # (a LoRA run's adapter for vLLM, in each host's /dev/shm: rlcore.rollout.lora.adapter_dir).
    outside = sorted({os.path.dirname(f["path"]) for f in failed.failures
                      if f["path"] and not os.path.abspath(f["path"]).startswith(os.path.abspath(output_dir) + os.sep)})
    place = ", ".join(outside) if outside and not failed.low_space else output_dir
    free = ""
    try:
        avail, mount = free_bytes(place.split(", ")[0])
        free = f" ({mb(avail)} free on {mount})"
    except OSError:
        pass
    shm = any(p.startswith("/dev/shm") for p in outside)
    row = last_whole_row(output_dir)
    lines = [head,
             f"  intact: {f'checkpoint {intact}' if intact else 'no complete checkpoint'}; metrics.jsonl "
             + (f"whole up to step {row}" if row is not None else "has no whole row"),
             *[f"  {c}" for c in cleanup],
             *(["  /dev/shm (memory) holds each rank's LoRA adapter for vLLM: a container's is often 64 MiB "
                "(docker run --shm-size=...)"] if shm else []),
             f"  to resume, once {place} {'has room' if failed.low_space else 'can be written'} again{free}"
             + (":" if outside and not failed.low_space else ", or on another filesystem:"),
             *[f"    {c}" for c in commands],
             f"  every rank exits with code {int(errors.Exit.STORAGE)} ({DEBUG_ENV}=1 prints the tracebacks)"]
    return "\n".join(lines)


def prints_message(failures: list[dict], rank: int) -> bool:
    """Rank 0 prints the message; so does the first failing rank of every other node (its log may be
    the only one that node's operator reads, and its local disk may be the one that failed)."""
    if rank == 0:
        return True
    mine = socket.gethostname()
    here = sorted(f["rank"] for f in failures if f["host"] == mine)
    return os.environ.get("GROUP_RANK", "0") != "0" and bool(here) and here[0] == rank
