"""Bucketed gather of dim-0 row shards into full tensors: many parameters per collective.

Helper of ``rlcore.engine_veomni`` for the weight sync into vLLM every step. It sees plain
tensors and process groups only: the engine (the one module that touches VeOmni, FSDP2 and
DTensor) describes each parameter as a ``ShardSpec`` and hands over its local shard (or, for
layouts this path does not handle, its full tensor) when asked.

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
than that gets a bucket of its own. Parameters without a shard group (not a plain dim-0 shard:
other placements, tensor parallel, unsharded) are exported alone through the engine's
``full(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardSpec:
    """One parameter as the gather sees it. ``group``: the process group over which it is split
    on dim 0 like ``torch.chunk`` (FSDP2's ``Shard(0)``); None: export it alone, whole."""

    name: str  # the engine's parameter name (the key of local/full)
    hf_name: str  # the name it is yielded under
    shape: tuple[int, ...]  # global (unsharded) shape
    dtype: torch.dtype
    group: object = None


def _sync_unit(hf_name: str) -> str:
    """Parameters that must travel in the same bucket: those under one grandparent module.
    ``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn`` keeps q/k/v (and
    ``mlp``: gate/up) of a layer together, which vLLM fuses into one parameter."""
    return hf_name.rsplit(".", 2)[0] if hf_name.count(".") >= 2 else ""


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
    def __init__(self, group, world: int, dtype: torch.dtype):
        self.group, self.world, self.dtype = group, world, dtype  # dtype: what the gather moves
        self.items: list[_Item] = []
        self.seg_numel = 0  # per-rank segment length; the gathered buffer is world x this
        self.nbytes = 0  # gathered size in the export dtype

    def add(self, spec: ShardSpec) -> None:
        item = _Item(spec.name, spec.hf_name, torch.Size(spec.shape), self.world, self.seg_numel)
        self.items.append(item)
        self.seg_numel += item.seg_numel

    @property
    def full_numel(self) -> int:
        return sum(math.prod(it.shape) for it in self.items)

    def launch(self, local: Callable, device, buffers: "SyncBuffers", pool):
        """Pack the local shards into this rank's segment of the gather buffer (in place: no
        separate send buffer; the copy casts to the bucket's dtype) and start gathering the
        others."""
        out = buffers.get("out", self.world * self.seg_numel, self.dtype, device)  # (W * S,)
        me = dist.get_rank(self.group)
        mine = out[me * self.seg_numel: (me + 1) * self.seg_numel]  # (S,)
        for it in self.items:
            local_shard = local(it.name).reshape(-1)  # (rank_rows * row_numel,)
            mine[it.offset: it.offset + local_shard.numel()].copy_(local_shard)
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
    """Ordered steps of a bucketed export: ``_Bucket`` (one all-gather) or a ``ShardSpec``
    exported alone through ``full`` (layouts the bucket path does not handle)."""

    def __init__(self, steps: list, dtype):
        self.steps, self.dtype = steps, dtype  # dtype None: every parameter keeps its own
        self.kept_buffers = SyncBuffers(keep=True)  # for callers that keep scratch memory between runs

    @classmethod
    def build(cls, specs: list[ShardSpec], dtype, bucket_bytes: int) -> "SyncPlan":
        units: dict[str, list[ShardSpec]] = {}
        for spec in specs:  # first appearance order; FSDP2 need not list q/k/v together
            units.setdefault(_sync_unit(spec.hf_name), []).append(spec)
        steps, current = [], None
        for members in units.values():
            for group, part in _split_by_group(members):
                if group is None:
                    steps.extend(part)
                    continue
                size = sum(_gathered_bytes(spec, dtype, dist.get_world_size(group)) for spec in part)
                if current is None or current.group is not group or current.dtype != (dtype or part[0].dtype) or \
                        (current.items and current.nbytes + size > bucket_bytes):
                    current = _Bucket(group, dist.get_world_size(group), dtype or part[0].dtype)
                    steps.append(current)
                for spec in part:
                    current.add(spec)
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

    def _reserve(self, device, buffers: "SyncBuffers") -> None:
        """Size the scratch buffers for the biggest bucket once, instead of growing them."""
        buckets = [s for s in self.steps if isinstance(s, _Bucket)]
        if not buckets:
            return
        dtype = buckets[0].dtype  # mixed dtypes (dtype=None over mixed parameters) regrow them
        buffers.get("out", max(b.world * b.seg_numel for b in buckets), dtype, device)
        buffers.reserve_arenas(max(b.full_numel for b in buckets), dtype, device)

    def run(self, local: Callable[[str], torch.Tensor], full: Callable[[str], torch.Tensor], device,
            buffers: "SyncBuffers") -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` for every parameter, in plan order (collective).
        ``local(name)``: this rank's shard of a bucketed parameter; ``full(name)``: a parameter
        exported alone, already whole and cast. Bucket i + 1 is gathered in the background while
        the caller consumes bucket i."""
        self._reserve(device, buffers)
        pending = None  # (bucket, work, out) in flight
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")  # gloo gathers
        try:
            for i, step in enumerate(self.steps):
                if not isinstance(step, _Bucket):
                    yield step.hf_name, full(step.name)
                    continue
                if pending is None:
                    pending = (step, *step.launch(local, device, buffers, pool))
                bucket, work, out = pending
                work.wait()
                tensors = bucket.unpack(out, buffers)  # out is free again: the next gather reuses it
                del out
                pending = None
                nxt = self.steps[i + 1] if i + 1 < len(self.steps) else None
                if isinstance(nxt, _Bucket):
                    pending = (nxt, *nxt.launch(local, device, buffers, pool))
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


def _split_by_group(members: list[ShardSpec]) -> list[tuple[object, list[ShardSpec]]]:
    """Consecutive runs of a unit's parameters that share a shard group (None: unbucketed)."""
    runs: list[tuple[object, list[ShardSpec]]] = []
    for spec in members:
        if runs and runs[-1][0] is spec.group:
            runs[-1][1].append(spec)
        else:
            runs.append((spec.group, [spec]))
    return runs


def _gathered_bytes(spec: ShardSpec, dtype, world: int) -> int:
    rows = spec.shape[0]
    elem = torch.empty((), dtype=dtype or spec.dtype).element_size()
    return -(-rows // world) * world * math.prod(spec.shape[1:]) * elem
