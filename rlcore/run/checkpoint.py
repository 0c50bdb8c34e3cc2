"""Run checkpoints: written into a temporary folder, renamed when complete, then the ``latest``
pointer updated; older ones pruned only after that. A half-written checkpoint is never loaded.

Layout: {output_dir}/checkpoints/step_{N}/ holds the policy's DCP state (model, optimizer, and in
VeOmni's per-rank extra-state files the LR scheduler and the trainer state: step, data position,
skip counters), rng_rank{r}.pt per rank (torch, numpy and python RNG, as plain tensors) and
meta.json (step, world size) and manifest.json (every file's size, written last: a folder whose
files do not match it is incomplete, e.g. truncated by a full disk or cut by a second run on the
same directory); {output_dir}/checkpoints/latest names the newest complete one.
The vLLM sampling seeds need no state: they are derived from (trainer.seed, step).

Unpickling: rng files are read with ``torch.load(weights_only=True)``. VeOmni reads its extra-state
files and DCP its ``.metadata`` with full pickle, so ``verify_plain`` first proves (without running
any foreign code) that they hold only plain data and DCP's metadata classes.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch

from rlcore.config import ConfigError
from rlcore.errors import require_folder, writing
from rlcore.run import storage

STEP_DIR = re.compile(r"^step_(\d+)$")
_EXTRA_STATE = os.path.join("extra_state", "extra_state_rank_{}.pt")  # VeOmni's per-rank file


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


# ---------------------------------------------------------------------------------------------
# RNG state as plain tensors (loadable with weights_only=True)
# ---------------------------------------------------------------------------------------------


def rng_state() -> dict:
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    for name, accel in _accelerators():  # only a device already in use: querying would initialise it
        if accel.is_initialized():
            state[name] = accel.get_rng_state()
    return state


def _accelerators():
    """(name, module) of the accelerator RNG modules present: torch.cuda, torch.npu (torch_npu).
    Both keep this rank's current device's generator (``get_rng_state()`` with no device)."""
    for name in ("cuda", "npu"):
        accel = getattr(torch, name, None)
        if accel is not None and accel.is_available():
            yield name, accel


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["words"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    for name, accel in _accelerators():
        if name in state:
            accel.set_rng_state(state[name])


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------


def save(policy, output_dir: str, step: int, trainer_state: dict, rank: int, keep_last: int,
         rng: dict | None = None, files: dict[str, dict] | None = None) -> str:
    """Collective: every rank calls it. ``rng`` overrides this rank's current RNG state (a snapshot
    taken earlier, e.g. at the start of an abandoned step). Returns the final checkpoint folder."""
    write(policy, output_dir, step, trainer_state, rank, rng, files)
    return commit(output_dir, step, rank, keep_last)


def write(policy, output_dir: str, step: int, trainer_state: dict, rank: int, rng: dict | None = None,
          files: dict[str, dict] | None = None) -> str:
    """Collective: the heavy part of ``save``, into ``.tmp-step_N``, which nothing resumes from
    until ``commit`` renames it (the loop writes in the train phase, while vLLM sleeps, and
    commits once the step's metrics row is written). ``files``: JSON files rank 0 writes beside
    meta.json (the run's config, rlcore.run.run_config). Returns the temporary folder. A failed
    write on any rank ends it on every rank together (``storage.StorageFailed``): each agreement
    below is where a barrier was."""
    import torch.distributed as dist

    root = checkpoint_root(output_dir)
    tmp = os.path.join(root, f".tmp-step_{step}")
    what = f"checkpoint step_{step}"
    with storage.section():
        if rank == 0:
            with writing(f"{what} (its folder)", tmp):
                require_folder(output_dir)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        storage.agree()
        # This rank's own file first: a disk already full or read-only stops every rank here, not in
        # VeOmni's per-rank extra-state file, which it writes before DCP's collectives (a rank failing
        # there alone would leave the others waiting in them). DCP's own save reports any rank's
        # failure to every rank.
        with writing(f"{what} (rank {rank}'s RNG state)", os.path.join(tmp, f"rng_rank{rank}.pt")):
            torch.save(rng if rng is not None else rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
        storage.agree()
        shards = f"{what} (model and optimizer shards, extra state)"
        with writing(shards, tmp), storage.thread_failures(shards, tmp):
            policy.save_checkpoint(tmp, extra_state={"trainer": trainer_state})
        storage.agree()
        if rank == 0:
            with writing(f"{what} (meta.json, manifest.json)", tmp):
                world = dist.get_world_size() if dist.is_initialized() else 1
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump({"step": step, "world_size": world}, f)
                _write_json_files(tmp, files or {})
                _write_manifest(tmp)
    return tmp


def commit(output_dir: str, step: int, rank: int, keep_last: int) -> str:
    """Collective: make ``write``'s folder the checkpoint of ``step`` (rename, ``latest``, prune)."""
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step_{step}")
    with storage.section():
        if rank == 0:
            with writing(f"checkpoint step_{step} (renamed into place, then named by latest)", final):
                _remove(final)  # a same-step folder from an earlier attempt of this run
                os.replace(os.path.join(root, f".tmp-step_{step}"), final)
                _write_latest(root, f"step_{step}")
                _prune(root, keep_last)
    return final


MANIFEST = "manifest.json"


def _write_json_files(folder: str, files: dict[str, dict]) -> None:
    for name, content in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=1)


def _write_manifest(folder: str) -> None:
    sizes = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(dirpath, name)
            sizes[os.path.relpath(full, folder)] = os.path.getsize(full)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": sizes}, f)
        f.flush()
        os.fsync(f.fileno())


def _write_latest(root: str, name: str) -> None:
    """``latest`` replaced atomically: written aside, flushed to disk, renamed over the old one (a
    failed write leaves the old ``latest`` as it was, and no temporary file)."""
    tmp = os.path.join(root, ".latest.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, "latest"))
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fd = os.open(root, os.O_RDONLY)  # the rename itself survives a crash once the folder is synced
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Rename, then delete: a folder killed half-way through deletion never looks like step_N."""
    if not os.path.exists(path):
        return
    doomed = os.path.join(os.path.dirname(path), ".del-" + os.path.basename(path))
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _prune(root: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints up to the one ``latest`` names. Folders
    past it (a run resumed from an older checkpoint into the same folder) and damaged ones are
    left alone: only this run's own superseded checkpoints are deleted."""
    latest = latest_step(os.path.dirname(root))
    if latest is None:
        return
    steps = sorted((int(m.group(1)), d) for d in os.listdir(root)
                   if (m := STEP_DIR.match(d)) and int(m.group(1)) <= latest and is_complete(os.path.join(root, d)))
    for _, d in steps[:-keep_last]:
        _remove(os.path.join(root, d))
    for d in os.listdir(root):  # leftovers of killed saves and deletions
        if d.startswith((".tmp-step_", ".del-step_")):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def latest_step(output_dir: str) -> int | None:
    """Step of the checkpoint ``latest`` points to, or None."""
    path = os.path.join(checkpoint_root(output_dir), "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        m = STEP_DIR.match(f.read().strip())
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# find / validate / load
# ---------------------------------------------------------------------------------------------


def problems(path: str) -> list[str]:
    """What keeps ``path`` from being a complete checkpoint, [] when nothing: a temp folder, DCP
    metadata or extra state missing, and (checkpoints with a manifest) every file missing or of
    another size than the save wrote."""
    if os.path.basename(os.path.normpath(path)).startswith("."):
        return ["a temporary folder of an unfinished save"]
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):  # written before manifests existed
        return [f"{name} is missing" for name in (".metadata", "extra_state")
                if not os.path.exists(os.path.join(path, name))]
    try:
        with open(manifest) as f:
            sizes = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return [f"{MANIFEST} is unreadable ({type(e).__name__})"]
    out = []
    for name, size in sorted(sizes.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            out.append(f"{name} is missing")
        elif os.path.getsize(full) != size:
            out.append(f"{name} is truncated ({os.path.getsize(full)} of {size} bytes)")
    return out


def is_complete(path: str) -> bool:
    """A folder the save above finished, with every file as it wrote it."""
    return not problems(path)


def find_resume(output_dir: str, resume: str, report=None) -> str | None:
    """The checkpoint folder to resume from: ``never`` -> None; ``auto`` -> the newest complete one
    in {output_dir}/checkpoints or None (newer incomplete ones are skipped, each named through
    ``report``, e.g. print); else PATH (a step folder, a checkpoints folder or a run's output_dir,
    resolved to its newest complete checkpoint). ConfigError when PATH has none, or when PATH is a
    step folder that is incomplete (naming the step and the file)."""
    if resume == "never":
        return None
    if resume == "auto":
        return _newest(checkpoint_root(output_dir), report)
    if is_complete(resume):
        return resume
    if STEP_DIR.match(os.path.basename(os.path.normpath(resume))) and os.path.isdir(resume):
        raise ConfigError(f"checkpoint.resume={resume!r} is incomplete: {'; '.join(problems(resume))}. It was cut "
                          f"short (a killed save, a full disk, or two runs writing one directory); resume from an "
                          f"earlier step_N folder, or use auto, which takes the newest complete one")
    found = _newest(resume, report) or _newest(checkpoint_root(resume), report)
    if found is None:
        raise ConfigError(
            f"checkpoint.resume={resume!r} is invalid: no complete checkpoint there (a step_N folder with "
            f"DCP .metadata and extra_state/); use auto, never, or a checkpoint folder such as "
            f"{checkpoint_root(output_dir)}/step_N")
    return found


def _newest(root: str, report=None) -> str | None:
    """``latest`` when it names a complete folder, else the highest complete step_N (a run killed
    between the rename and the pointer update, or a damaged newest checkpoint: named through
    ``report``), else None."""
    if not os.path.isdir(root):
        return None
    latest = os.path.join(root, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(root, f.read().strip())
        if is_complete(path):
            return path
    steps = sorted((int(m.group(1)), d) for d in os.listdir(root) if (m := STEP_DIR.match(d)))
    skipped = []
    for _, d in reversed(steps):
        path = os.path.join(root, d)
        wrong = problems(path)
        if not wrong:
            if skipped and report is not None:
                report(f"checkpoint.resume: skipping incomplete {'; '.join(skipped)}; resuming from {d}")
            return path
        skipped.append(f"{d} ({'; '.join(wrong)})")
    if skipped and report is not None:
        report(f"checkpoint.resume: no complete checkpoint; skipping incomplete {'; '.join(skipped)}")
    return None


def validate_resume(path: str, rank: int, world_size: int) -> None:
    """Before any model loads: the checkpoint fits this world size and holds only plain data."""
    meta_file = os.path.join(path, "meta.json")
    saved_world = None
    if os.path.isfile(meta_file):
        with open(meta_file) as f:
            saved_world = json.load(f).get("world_size")
    if saved_world is not None and saved_world != world_size:
        raise ConfigError(
            f"checkpoint.resume: {path} was written by {saved_world} ranks but this run has {world_size}; "
            f"resume with --nproc_per_node/--nnodes giving {saved_world} ranks, or start fresh with "
            f"checkpoint.resume=never (or another trainer.output_dir)")
    extra = os.path.join(path, _EXTRA_STATE.format(rank))
    if not os.path.isfile(extra):
        raise ConfigError(f"checkpoint.resume: {path} has no state for rank {rank} ({extra} is missing); "
                          f"it was written by fewer ranks or is damaged; resume with the original world size")
    verify_plain(path)


def verify_plain(path: str) -> None:
    """Every pickle in the checkpoint holds only what this trainer writes, checked without running
    foreign code: the extra-state and RNG files load with weights_only=True (tensors and plain
    containers), DCP's .metadata with an unpickler that knows only DCP's own metadata classes.
    VeOmni and DCP then read them with full pickle."""
    files = sorted(glob.glob(os.path.join(path, "extra_state", "*.pt")) + glob.glob(os.path.join(path, "rng_rank*.pt")))
    for f in files:
        try:
            torch.load(f, weights_only=True, map_location="cpu")
        except Exception as e:
            _refuse(f, e)
    metadata = os.path.join(path, ".metadata")
    try:
        with open(metadata, "rb") as f:
            _DcpMetadataUnpickler(f).load()
    except Exception as e:
        _refuse(metadata, e)


# What a safe-unpickling refusal says (torch's weights_only loader, _DcpMetadataUnpickler): only these
# mean foreign content; any other failure is a file that is missing, cut short or damaged.
_UNSAFE = ("Weights only load failed", "is not part of DCP metadata")


def _refuse(f: str, e: Exception) -> None:
    step = os.path.basename(os.path.dirname(f.replace(os.sep + "extra_state" + os.sep, os.sep)))
    if isinstance(e, FileNotFoundError):
        raise ConfigError(f"checkpoint.resume: {step} is incomplete: {f} is missing (a killed save, or two runs "
                          f"writing one directory); resume from an earlier checkpoint or use auto") from e
    if not any(text in str(e) for text in _UNSAFE):
        raise ConfigError(f"checkpoint.resume: {step} is damaged: {f} cannot be read ({type(e).__name__}: {e}), "
                          f"e.g. truncated by a full disk or a killed write; resume from an earlier checkpoint "
                          f"or use auto") from e
    raise ConfigError(f"checkpoint.resume: {f} holds more than this trainer's checkpoint data ({type(e).__name__}: "
                      f"{e}); refusing to unpickle it. Resume only from checkpoints this trainer wrote.") from e


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes a DCP ``.metadata`` file refers to (DCP's dataclasses and enums,
    torch.Size, dtypes, layouts, paths); any other global (os.system, ...) is an error."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}

    def find_class(self, module: str, name: str):
        allowed = (module, name) in self._ALLOWED or module.startswith("torch.distributed.checkpoint.")
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")
        return super().find_class(module, name)


def load(policy, path: str, rank: int) -> dict:
    """Collective: restores the policy, optimizer, scheduler and this rank's RNG; returns trainer state."""
    verify_plain(path)
    extra = policy.load_checkpoint(path)
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=True, map_location="cpu"))
    return extra["trainer"]


# ---------------------------------------------------------------------------------------------
# logs of a resumed run, HF export
# ---------------------------------------------------------------------------------------------


def trim_metrics(output_dir: str, step: int) -> int:
    """Drop metrics.jsonl rows with step > ``step`` (written by a run killed after its last
    checkpoint; the resumed run writes them again). In place, so an open append handle stays
    valid. Returns the number of rows removed."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    with open(path, "r+") as f:
        lines = f.read().splitlines(keepends=True)
        keep = [line for line in lines if _row_step(line) <= step]
        if len(keep) == len(lines):
            return 0
        f.seek(0)
        f.writelines(keep)
        f.truncate()
    return len(lines) - len(keep)


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a torn last line from a killed run


def purge_tensorboard(logger, step: int) -> None:
    """Tell TensorBoard to drop earlier events with step > ``step`` (what SummaryWriter(purge_step=)
    writes), so a resumed run's curves have no duplicate tail."""
    writer = getattr(logger, "writer", None)
    if writer is None:
        return
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    writer.file_writer.add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
    writer.flush()


def export_hf(policy, path: str, dtype: str, is_main: bool, output_dir: str | None = None) -> None:
    """Collective: an HF safetensors folder written into a temp folder, renamed when complete. A
    failed write (rank 0 writes while every rank gathers) is recorded and the gathers go on
    (rlcore.hf_folder), then every rank stops together; the checkpoints are not touched.
    ``output_dir``: the run's folder, which must still exist (``require_folder``)."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), ".tmp-" + os.path.basename(path))
    what = f"the HF export {path}"
    with storage.section():
        if is_main:
            with writing(what, tmp):
                if output_dir is not None:
                    require_folder(output_dir)
                shutil.rmtree(tmp, ignore_errors=True)
        storage.agree()
        with writing(what, tmp):
            policy.save_hf(tmp, dtype=dtype)  # ends with a barrier: rank 0 has written everything
        storage.agree()
        if is_main:
            with writing(f"{what} (renamed into place)", path):
                _remove(path)
                os.replace(tmp, path)


def size(path: str) -> int:
    """Bytes of the checkpoint folder ``path``, from its manifest (else its files)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return sum(json.load(f)["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return storage.folder_bytes(path)


def leftovers(output_dir: str) -> list[str]:
    """What a failed save or export leaves: ``.tmp-step_N`` and ``.del-step_N`` folders, the
    ``latest`` being written, HF exports being written. A resume never loads any of them."""
    root, out = checkpoint_root(output_dir), os.path.abspath(output_dir)
    found = glob.glob(os.path.join(root, ".tmp-step_*")) + glob.glob(os.path.join(root, ".del-step_*"))
    found += glob.glob(os.path.join(root, ".latest.tmp")) + glob.glob(os.path.join(out, "hf", ".tmp-*"))
    return sorted(found + glob.glob(os.path.join(out, ".tmp-hf_final")))
