"""LoRA on the rollout engine: vLLM built with LoRA for the policy's rank; after each update the
adapter's tensors are written where vLLM's LoRA loading reads them and reloaded in place under
one adapter id, and every generate and score call then runs with it. vLLM's base weights are
never written after the engine loads them.

vllm 0.32 (and 0.23, the Ascend pin: the same API): ``LoRARequest(lora_name, lora_int_id,
lora_path, load_inplace)`` (lora/request.py:24-28); ``load_inplace`` reloads an id that is
already loaded (lora/worker_manager.py:289-314); ``LLMEngine.add_lora`` loads one outside a
request (v1/engine/llm_engine.py:469). vLLM reads adapters from a folder only, so the folder is a
per-process one under /dev/shm (tmpfs: memory, no disk). ``max_lora_rank`` must be one of
vLLM's sizes (``MaxLoRARanks``, config/lora.py:26, read from the installed vLLM: ``ranks``); a
smaller adapter is padded to it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from rlcore import errors, hf_folder

NAME, ADAPTER_ID = "policy", 1


def ranks() -> tuple[int, ...]:
    """The LoRA ranks the installed vLLM builds (its ``MaxLoRARanks``; imported here, not at
    module import: this module imports without vLLM)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(get_args(MaxLoRARanks)))


def engine_kwargs(rank: int) -> dict:
    """The ``LLM(...)`` keywords of an engine that serves the policy's adapter (one at a time)."""
    if rank <= 0:
        return {}
    sizes = ranks()
    fits = [r for r in sizes if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank={rank} is above vLLM's largest LoRA rank {sizes[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


PREFIX = "rlcore-lora-"


def adapter_dir(root: str | None = None) -> str:
    """This process's adapter folder: in tmpfs where there is one. The folders of processes that
    are gone go first: a run ended by kill -9 (or a node's OOM killer) cannot remove its own, and
    in /dev/shm each one holds the adapter's bytes in memory until the host reboots."""
    if root is None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    remove_stale_adapter_dirs(root)
    return os.path.join(root, f"{PREFIX}{os.getpid()}")


def remove_stale_adapter_dirs(root: str) -> list[str]:
    """Remove ``root``'s adapter folders whose process no longer exists; returns their paths. A
    live pid keeps its folder, whoever holds it now (a reused pid costs one folder, never a live one)."""
    removed = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        pid = name[len(PREFIX):]
        if not (name.startswith(PREFIX) and pid.isdigit()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(os.path.join(root, name))
    return removed


def write_for_engine(tensors, config: dict) -> tuple[str | None, tuple[int, int]]:
    """This rank's adapter for its engine, in its own folder (``adapter_dir``: /dev/shm, local to the
    host); returns (the folder, (tensors, bytes)). A failed write is recorded, not raised (folder
    None): the rank stays in step with the others, its engine keeps the previous adapter, and every
    rank stops together at the step's agreement point (rlcore.run.lifecycle.commit_checkpoint)
    before anything generated with it is trained or a checkpoint is committed."""
    path = adapter_dir()
    before = len(errors.pending())
    with errors.deferred():
        written = hf_folder.write_adapter(tensors, config, path)
    return (None, (0, 0)) if len(errors.pending()) > before else (path, written)


def load(llm, path: str):
    """vLLM reloads the adapter at ``path`` in place (id ``ADAPTER_ID``); returns the request that
    generate and score pass from now on."""
    from vllm.lora.request import LoRARequest

    llm.llm_engine.add_lora(LoRARequest(NAME, ADAPTER_ID, path, load_inplace=True))
    return LoRARequest(NAME, ADAPTER_ID, path)
