"""Bucketed export of FSDP2-sharded weights as full tensors: many parameters per collective.

Private helper of ``rlcore.engine_veomni`` (the engine owns everything FSDP2/DTensor; this file
only keeps it under a readable size). Used for the weight sync into vLLM every step.

Layout. FSDP2 shards every parameter on dim 0 like ``torch.chunk`` over the shard group of W
ranks: rank r holds rows ``[r * chunk, min((r + 1) * chunk, rows))`` with ``chunk = ceil(rows / W)``,
so the last non-empty rank may hold fewer rows and ranks after it none (uneven shards). A bucket
gives each of its parameters ``chunk * row_numel`` elements of room in a per-rank segment of
``S`` elements, the same offsets on every rank. Each rank packs its local shards into its own
segment of the ``(W, S)`` gather buffer (the copy casts to the export dtype, so the gather moves
export-dtype bytes), one gather fills the other segments (``all_gather_into_tensor`` on NCCL/HCCL,
one broadcast per rank on gloo: see ``_start_gather``), and each full tensor is copied out of it
rank by rank (padding of short shards is never read).

Pipeline: bucket i + 1 is gathered in the background while the caller loads bucket i; the
scratch memory is the gather buffer plus the full tensors of the bucket being consumed, about two
buckets (three, kept between syncs, on CPU: see ``SyncBuffers``).

Buckets are filled in parameter order with whole "sync units" (all parameters under one
grandparent module: ``model.layers.3.self_attn`` holds q/k/v, ``model.layers.3.mlp`` gate/up,
which vLLM fuses into one parameter each), up to ``bucket_bytes`` of gathered data; a unit larger
than that gets a bucket of its own. Parameters whose layout is not a plain dim-0 shard (other
placements, tensor parallel, non-DTensors) are exported alone with ``full_tensor()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _sync_unit(hf_name: str) -> str:
    """Parameters that must travel in the same bucket: those under one grandparent module.
    ``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn`` keeps q/k/v (and
    ``mlp``: gate/up) of a layer together, which vLLM fuses into one parameter."""
    return hf_name.rsplit(".", 2)[0] if hf_name.count(".") >= 2 else ""


def _shard_group(param):
    """The process group to gather ``param`` over when it is a plain dim-0 FSDP2 shard (one
    ``Shard(0)`` mesh dim, the others ``Replicate``, as with FSDP and HSDP); None otherwise
    (not a DTensor, replicated, or a layout this path does not handle: full_tensor() then)."""
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    shard_dims = [i for i, p in enumerate(param.placements) if type(p) is Shard]
    others_replicated = all(isinstance(p, Replicate) for i, p in enumerate(param.placements) if i not in shard_dims)
    if len(shard_dims) != 1 or param.placements[shard_dims[0]].dim != 0 or not others_replicated:
        return None
    if param.dim() == 0:
        return None
    return param.device_mesh.get_group(shard_dims[0])


class _Item:
    """One parameter of a bucket. FSDP2 shards dim 0 like ``torch.chunk``: every rank holds
    ``chunk = ceil(rows / W)`` rows except the last non-empty one (the rest) and any after it
    (none). In the bucket's per-rank segment each parameter takes ``chunk`` rows' room, so the
    layout is the same on every rank; shorter shards leave padding that is never read."""

    def __init__(self, name: str, hf_name: str, shape: torch.Size, world: int, offset: int):
        self.name, self.hf_name, self.shape, self.offset = name, hf_name, shape, offset
        self.rows = shape[0]
        self.row_numel = math.prod(shape[1:])
        self.chunk = -(-self.rows // world)  # ceil
        self.seg_numel = self.chunk * self.row_numel  # room in each rank's segment

    def rank_rows(self, r: int) -> int:
        return max(0, min(self.chunk, self.rows - r * self.chunk))


class _Bucket:
    def __init__(self, group, world: int):
        self.group, self.world = group, world
        self.items: list[_Item] = []
        self.seg_numel = 0  # per-rank segment length; the gathered buffer is world x this
        self.nbytes = 0  # gathered size in the export dtype

    def add(self, name: str, hf_name: str, param) -> None:
        item = _Item(name, hf_name, param.shape, self.world, self.seg_numel)
        self.items.append(item)
        self.seg_numel += item.seg_numel

    @property
    def full_numel(self) -> int:
        return sum(math.prod(it.shape) for it in self.items)

    def launch(self, params: dict, dtype, device, buffers: "SyncBuffers", pool):
        """Pack the local shards into this rank's segment of the gather buffer (in place: no
        separate send buffer; the copy casts to ``dtype``) and start gathering the others."""
        dtype = dtype or params[self.items[0].name].dtype
        out = buffers.get("out", self.world * self.seg_numel, dtype, device)  # (W * S,)
        me = dist.get_rank(self.group)
        mine = out[me * self.seg_numel: (me + 1) * self.seg_numel]  # (S,)
        for it in self.items:
            local = params[it.name].to_local().reshape(-1)  # (rank_rows * row_numel,)
            mine[it.offset: it.offset + local.numel()].copy_(local)
        return _start_gather(out, mine, self.group, pool), out

    def unpack(self, out: torch.Tensor, buffers: "SyncBuffers") -> list[tuple[str, torch.Tensor]]:
        """Rank segments -> full tensors (rank r's rows start at row r * chunk)."""
        seg = out.view(self.world, self.seg_numel)  # (W, S)
        fulls = buffers.full_tensors([it.shape for it in self.items], out.dtype, out.device)
        result = []
        for it, full in zip(self.items, fulls):
            flat = full.view(-1)
            for r in range(self.world):
                n = it.rank_rows(r) * it.row_numel
                start = r * it.seg_numel
                flat[start: start + n].copy_(seg[r, it.offset: it.offset + n])
            result.append((it.hf_name, full))
        return result


class SyncPlan:
    """Ordered steps of a bucketed export: ``_Bucket`` (one all-gather) or a parameter name
    exported alone through ``full_tensor()`` (layouts the bucket path does not handle)."""

    def __init__(self, steps: list, dtype):
        self.steps, self.dtype = steps, dtype
        self.kept_buffers = SyncBuffers(keep=True)  # for callers that keep scratch memory between runs

    @classmethod
    def build(cls, named: list, dtype, bucket_bytes: int, hf_name=lambda n: n) -> "SyncPlan":
        units: dict[str, list] = {}
        for name, p in named:  # first appearance order; FSDP2 need not list q/k/v together
            units.setdefault(_sync_unit(hf_name(name)), []).append((name, p))
        steps, current = [], None
        for members in units.values():
            for group, part in _split_by_group(members):
                if group is None:
                    steps.extend((name, hf_name(name)) for name, _ in part)
                    continue
                size = sum(_gathered_bytes(p, dtype, dist.get_world_size(group)) for _, p in part)
                if current is None or current.group is not group or \
                        (current.items and current.nbytes + size > bucket_bytes):
                    current = _Bucket(group, dist.get_world_size(group))
                    steps.append(current)
                for name, p in part:
                    current.add(name, hf_name(name), p)
                current.nbytes += size
        return cls(steps, dtype)

    def summary(self) -> dict:
        buckets = [s for s in self.steps if isinstance(s, _Bucket)]
        return {
            "buckets": len(buckets),
            "unbucketed": len(self.steps) - len(buckets),
            "params": sum(len(b.items) for b in buckets) + len(self.steps) - len(buckets),
            "max_bucket_mb": max((b.nbytes for b in buckets), default=0) / 2**20,
            "kept_scratch_mb": self.kept_buffers.nbytes() / 2**20,
            "fresh_arenas": self.kept_buffers.fresh_arenas,
        }

    def _reserve(self, params: dict, device, buffers: "SyncBuffers") -> None:
        """Size the scratch buffers for the biggest bucket once, instead of growing them."""
        buckets = [s for s in self.steps if isinstance(s, _Bucket)]
        if not buckets:
            return
        dtype = self.dtype or params[buckets[0].items[0].name].dtype
        buffers.get("out", max(b.world * b.seg_numel for b in buckets), dtype, device)
        buffers.reserve_arenas(max(b.full_numel for b in buckets), dtype, device)

    def run(self, params: dict, device, buffers: "SyncBuffers") -> Iterator[tuple[str, torch.Tensor]]:
        """Gather bucket i + 1 in the background while the caller consumes bucket i."""
        self._reserve(params, device, buffers)
        pending = None  # (bucket, work, out) in flight
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")  # gloo gathers
        try:
            for i, step in enumerate(self.steps):
                if not isinstance(step, _Bucket):
                    name, hf = step
                    yield hf, full_tensor(params[name], self.dtype, device)
                    continue
                if pending is None:
                    pending = (step, *step.launch(params, self.dtype, device, buffers, pool))
                bucket, work, out = pending
                work.wait()
                tensors = bucket.unpack(out, buffers)  # out is free again: the next gather reuses it
                del out
                pending = None
                nxt = self.steps[i + 1] if i + 1 < len(self.steps) else None
                if isinstance(nxt, _Bucket):
                    pending = (nxt, *nxt.launch(params, self.dtype, device, buffers, pool))
                tensors.reverse()
                while tensors:  # hand each tensor over: the caller then holds the only reference
                    yield tensors.pop()
        finally:
            if pending is not None:  # consumer stopped early: never free a buffer in flight
                pending[1].wait()
            pool.shutdown(wait=True)


class SyncBuffers:
    """Scratch memory of a bucketed export: the gather buffer (W segments; this rank packs into
    its own) and the memory the full tensors handed to the caller live in.

    ``keep=False`` (accelerators): the gather buffer is reused from bucket to bucket and every
    full tensor is its own allocation, freed as soon as the caller drops it (the caching
    allocator makes that cheap). Peak: about two buckets.

    ``keep=True`` (CPU): the full tensors are views of two arenas used in turn, and all three
    buffers are kept from sync to sync. Every fresh CPU allocation above glibc's mmap threshold
    (32 MiB) is a new mapping whose pages fault in on first write, which costs more than the
    copies themselves. Two arenas, not one: when bucket i + 1 is cut out, the caller still holds
    the last tensor of bucket i (a loop variable), so that arena is busy. An arena is reused only
    when nothing outside holds a view of it (storage use count back to our own reference);
    otherwise a fresh one is taken, so a caller that keeps tensors never sees them overwritten.
    Scratch: three buckets, kept.
    """

    def __init__(self, keep: bool):
        self.keep = keep
        self._bufs: dict[str, torch.Tensor] = {}
        self._turn = 0  # which arena the next bucket prefers
        self.fresh_arenas = 0  # arenas allocated because both were busy (tests, benchmarks)

    def get(self, kind: str, numel: int, dtype, device) -> torch.Tensor:
        buf = self._bufs.get(kind)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
            self._bufs.pop(kind, None)  # drop ours before allocating its successor
            buf = self._bufs[kind] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def full_tensors(self, shapes: list, dtype, device) -> list[torch.Tensor]:
        """Uninitialised tensors of ``shapes`` for one bucket."""
        if not self.keep:
            return [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        numels = [math.prod(shape) for shape in shapes]
        arena = self._free_arena(sum(numels), dtype, device)
        out, pos = [], 0
        for shape, n in zip(shapes, numels):
            out.append(arena[pos: pos + n].view(shape))
            pos += n
        return out

    def reserve_arenas(self, numel: int, dtype, device) -> None:
        if self.keep:
            for name in ("arena0", "arena1"):
                self.get(name, numel, dtype, device)

    def _free_arena(self, numel: int, dtype, device) -> torch.Tensor:
        for k in (self._turn, 1 - self._turn):
            name = f"arena{k}"
            buf = self._bufs.get(name)
            if buf is None or _is_free(buf):
                self._turn = 1 - k
                return self.get(name, numel, dtype, device)
        name = f"arena{self._turn}"  # both busy: leave the older one to the caller, take a new one
        self._bufs.pop(name)
        self.fresh_arenas += 1
        self._turn = 1 - self._turn
        return self.get(name, numel, dtype, device)

    def clear(self) -> None:
        self._bufs.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def _is_free(buf: torch.Tensor) -> bool:
    """Nothing but ``buf`` itself refers to its storage (False where torch cannot tell)."""
    if not _can_count_uses():
        return False
    # Our tensor holds one reference; the temporary storage object made to ask holds another.
    return _use_count(buf) <= 2


def _can_count_uses() -> bool:
    return hasattr(torch._C, "_storage_Use_Count")


def _use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (every view holds one)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _start_gather(out: torch.Tensor, mine: torch.Tensor, group, pool):
    """Start filling ``out`` (W segments) from every rank's ``mine``; returns an object with
    ``wait()``.

    NCCL/HCCL: one asynchronous in-place ``all_gather_into_tensor`` (what FSDP2 itself does).
    gloo: one broadcast per rank, run in order on a helper thread so that the caller can load
    the previous bucket meanwhile. Measured on 2 CPU ranks: 2 GB/s for the broadcasts against
    0.3-0.5 GB/s for gloo's all_gather, whose ring moves the same bytes in many more steps.
    """
    if dist.get_backend(group) != "gloo":
        return dist.all_gather_into_tensor(out, mine, group=group, async_op=True)
    world, seg = dist.get_world_size(group), mine.numel()

    def broadcasts() -> None:
        for i in range(world):
            dist.broadcast(out[i * seg: (i + 1) * seg], src=dist.get_global_rank(group, i), group=group)

    return _FutureWork(pool.submit(broadcasts))


class _FutureWork:
    def __init__(self, future):
        self.future = future

    def wait(self) -> None:
        self.future.result()


def _split_by_group(members: list) -> list[tuple[object, list]]:
    """Consecutive runs of a unit's parameters that share a shard group (None: unbucketed)."""
    runs: list[tuple[object, list]] = []
    for name, p in members:
        g = _shard_group(p)
        if runs and runs[-1][0] is g:
            runs[-1][1].append((name, p))
        else:
            runs.append((g, [(name, p)]))
    return runs


def _gathered_bytes(param, dtype, world: int) -> int:
    rows = param.shape[0]
    elem = torch.empty((), dtype=dtype or param.dtype).element_size()
    return -(-rows // world) * world * math.prod(param.shape[1:]) * elem


def full_tensor(param, dtype, device) -> torch.Tensor:
    """One parameter, cast on the local shard first, gathered on ``device``."""
    t = param.detach()
    if dtype is not None:
        t = t.to(dtype)
    if t.device != device:
        t = t.to(device)
    return t.full_tensor() if isinstance(t, DTensor) else t
