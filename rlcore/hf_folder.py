"""An HF model folder as files: its ``config.json`` (read here and nowhere else) and the writing of a
safetensors folder from a stream of ``(name, full tensor)`` pairs. Plain file IO.

The policy engine (``rlcore.engine_veomni.VeOmniPolicy.save_hf``) gathers the tensors and hands
them to ``ShardWriter`` on rank 0; nothing here knows about FSDP2, DTensor or VeOmni.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from rlcore.errors import pending, writing

# Files of the source folder that the export must not copy: weights it rewrites, and config.json,
# which it rewrites with the export dtype.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class ShardWriter:
    """Accumulate tensors into safetensors shards of bounded size (rank 0 only)."""

    def __init__(self, path: str, max_shard_bytes: int):
        os.makedirs(path, exist_ok=True)
        self.path, self.max_bytes = path, max_shard_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temp file name, tensor names)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.shard and self.shard_bytes + nbytes > self.max_bytes:
            self._flush()
        self.shard[name] = tensor.contiguous()
        self.shard_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        fname = f"tmp-{len(self.files):05d}.safetensors"
        save_file(self.shard, os.path.join(self.path, fname), metadata={"format": "pt"})
        self.files.append((fname, list(self.shard)))
        self.shard, self.shard_bytes = {}, 0

    def close(self) -> None:
        """Flush, then give the shards their final names (model.safetensors, or numbered
        shards plus model.safetensors.index.json)."""
        if self.shard or not self.files:
            self._flush()
        n = len(self.files)
        weight_map, total = {}, 0
        for i, (tmp, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.path, tmp), os.path.join(self.path, final))
            os.chmod(os.path.join(self.path, final), 0o644)  # safetensors writes 0600
            total += os.path.getsize(os.path.join(self.path, final))
            weight_map.update({name: final for name in names})
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)


def write_folder(weights, path: str, source: str, dtype: str, is_main: bool, max_shard_bytes: int) -> None:
    """Stream ``weights`` (every rank iterates: the gathers are collective) into ``path`` on the
    main rank, then copy ``source``'s non-weight files (config.json with ``dtype``). A write that
    fails inside the run's deferred block (rlcore.errors.deferred) is recorded there; the main rank
    then writes nothing more but goes on through every gather, as the other ranks do."""
    writer = None
    if is_main:
        with writing("an HF export (its folder)", path):
            writer = ShardWriter(path, max_shard_bytes)
    for name, tensor in weights:
        if writer is not None and not pending():
            with writing("an HF export (a safetensors shard)", path):
                writer.add(name, tensor.cpu())
        del tensor
    if writer is not None and not pending():
        with writing("an HF export (its last shard, index and model files)", path):
            writer.close()
            copy_aux_files(source, path, dtype)


def write_adapter(tensors, config: dict, path: str) -> tuple[int, int]:
    """A PEFT adapter folder: adapter_model.safetensors (written aside, then renamed: a reader
    never sees half a file) and adapter_config.json. Returns (tensors, bytes). ``tensors`` may be
    collective gathers: all of them are taken before anything is written, so a failed write never
    leaves the other ranks in a gather."""
    from safetensors.torch import save_file

    state = {name: t.detach().cpu().contiguous() for name, t in tensors}
    with writing("a LoRA adapter folder", path):
        os.makedirs(path, exist_ok=True)
        tmp = os.path.join(path, ".adapter_model.safetensors.tmp")
        save_file(state, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return len(state), sum(t.numel() * t.element_size() for t in state.values())


def read_config(path: str):
    """The parsed ``config.json`` of the HF folder ``path``. Raises OSError (no such file) or
    ValueError (not JSON); callers decide what a missing or broken file means for them."""
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def config_or_empty(path: str) -> dict:
    """``read_config`` as a dict, ``{}`` when there is none to read (a hub id, a broken file: the
    folder's own checks name what is wrong with it)."""
    try:
        config = read_config(path)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def folder_problem(path: str) -> str | None:
    """Why ``path`` is not a local HF model folder (no config.json there), with how to get one; None
    when it is. Models are read from a local folder here: nothing is downloaded at run time."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    if not os.path.exists(path) and path.count("/") == 1 and not path.startswith((".", "~")):
        local = f"/models/{path.split('/')[1]}"
        return (f"no config.json there: {path!r} looks like a Hugging Face hub name, and models are read from a local "
                f"folder here (nothing is downloaded at run time). Download it first, e.g. `hf download {path} "
                f"--local-dir {local}` (huggingface_hub's CLI; `huggingface-cli download` in older versions), and "
                f"point the key at {local}")
    return "no config.json there; point it to a local HF model folder (scripts/ can make one)"


def num_experts(model_config: dict) -> int:
    """Routed experts of an HF config (0 for a dense model)."""
    cfg = model_config.get("text_config", model_config)
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def model_num_experts(path: str) -> int:
    """Routed experts in the config.json at ``path`` (0: dense, or no readable config there)."""
    return num_experts(config_or_empty(path))


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names -> shapes of the safetensors checkpoint in ``model_path`` (headers only)."""
    from safetensors import safe_open

    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    shapes = {}
    for fname in files:
        with safe_open(os.path.join(model_path, fname), "pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def fused_expert_names(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """The first MoE layer's routed experts as the weight sync sends them fused: HF name -> shape,
    ``...mlp.experts.gate_up_proj`` and ``...down_proj``. The checkpoint's own shapes where it stores
    them fused (Qwen3-VL-MoE), else VeOmni's ``[E, 2I, H]`` / ``[E, H, I]`` (rlcore.engine.moe's
    FUSED_LAYOUT) under the per-expert names' prefix. None: a dense model, or no expert tensor found."""
    config = config_or_empty(model_path)
    if not num_experts(config):
        return None
    shapes = checkpoint_shapes(model_path)
    for name in sorted(shapes):
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            continue
        prefix = head + sep
        if tail in ("gate_up_proj", "down_proj"):
            return {prefix + k: shapes[prefix + k] for k in ("gate_up_proj", "down_proj")}
        text = config.get("text_config", config)
        e, h, i = num_experts(config), int(text["hidden_size"]), int(text["moe_intermediate_size"])
        return {prefix + "gate_up_proj": (e, 2 * i, h), prefix + "down_proj": (e, h, i)}
    return None


def adapter_rank(path: str) -> int:
    """The LoRA rank ``r`` of the PEFT adapter folder ``path`` (its adapter_config.json)."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        return int(json.load(f)["r"])


def copy_aux_files(src: str, dst: str, dtype: str) -> None:
    """Copy the non-weight files of the source folder; rewrite config.json with ``dtype``."""
    for fname in os.listdir(src):
        full = os.path.join(src, fname)
        if not os.path.isfile(full) or fname == "config.json" or fname.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copy2(full, os.path.join(dst, fname))
    config = read_config(src)
    # transformers 5 writes "dtype"; older configs carry "torch_dtype". Keep whichever exists.
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
