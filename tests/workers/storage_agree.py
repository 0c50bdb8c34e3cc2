"""Two gloo ranks meet a failed write where the trainer meets one (rlcore.run.storage), each case
on storage the test made fail for real (tests/test_storage.py mounts it):

  rank0_only  rank 0 writes a file into READONLY (a read-only bind mount) while rank 1 goes straight
              to the agreement (where a barrier was): both raise StorageFailed, naming rank 0
  dcp         torch.distributed.checkpoint.save into SMALL_DCP (a tmpfs too small for rank 1's
              tensors, not for rank 0's), four writer threads a rank: DCP's own protocol tells every
              rank of the main thread's failure, rlcore.run.storage.thread_failures of a writer
              thread's (which DCP drops); both stop together
  stream      rank 0 streams an HF export into SMALL_HF (a tmpfs too small for it) while every
              rank all-reduces each tensor first, as save_hf's gathers do: rank 0 goes on through
              every collective after its write failed; both stop together
  clean       nothing fails: the agreement returns on both ranks

Usage: storage_agree.py READONLY SMALL_DCP SMALL_HF. Prints one ``result {json}`` line per case and rank.
"""

import gc

gc.disable()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlcore import errors, hf_folder  # noqa: E402
from rlcore.dist import init_distributed  # noqa: E402
from rlcore.run import storage  # noqa: E402


def rank0_only(rank: int, readonly: str) -> None:
    with storage.section():
        if rank == 0:
            with errors.writing("a file of rank 0", readonly):
                with open(os.path.join(readonly, "latest"), "w") as f:
                    f.write("step_1\n")


def dcp(rank: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp_api
    from torch.distributed.checkpoint import FileSystemWriter

    # rank 0's tensors are 4 KiB each, rank 1's 1 MiB: only rank 1's files meet the full disk. Four
    # writer threads per rank, as VeOmni's writer has 16: a thread's failure is DCP's blind spot.
    state = {f"rank{rank}_{i}": torch.ones(1024 if rank == 0 else 256 * 1024) for i in range(4)}
    writer = FileSystemWriter(folder, thread_count=4, single_file_per_rank=True, sync_files=False)
    with storage.section():
        with errors.writing("DCP shards", folder), storage.thread_failures("DCP shards", folder):
            dcp_api.save(state, storage_writer=writer)


GATHERED: list[int] = []  # the stream case's collectives this rank took part in


def stream(rank: int, folder: str) -> None:
    def weights():  # 8 tensors of 512 KiB, each one a collective on every rank (save_hf's gathers)
        for i in range(8):
            t = torch.full((128 * 1024,), float(i))
            dist.all_reduce(t)
            GATHERED.append(i)
            yield f"w{i}", t

    with storage.section():
        with errors.writing("an HF export", folder):
            hf_folder.write_folder(weights(), folder, folder, "float32", rank == 0, 256 * 1024)
        dist.barrier()  # save_hf ends with one


def main() -> None:
    readonly, small_dcp, small_hf = sys.argv[1:4]
    info = init_distributed("cpu", 60)
    cases = [("rank0_only", lambda: rank0_only(info.rank, readonly)), ("dcp", lambda: dcp(info.rank, small_dcp)),
             ("stream", lambda: stream(info.rank, small_hf)), ("clean", lambda: storage.agree())]
    for name, case in cases:
        start, out = time.monotonic(), {"case": name, "rank": info.rank, "failed": False}
        try:
            case()
        except storage.StorageFailed as e:
            out.update(failed=True, failures=e.failures)
        if name == "stream":
            out["gathered"] = GATHERED
        out["seconds"] = round(time.monotonic() - start, 3)
        errors.pending().clear()  # the next case starts clean (a run ends at its first failure)
        os.write(1, ("result " + json.dumps(out) + "\n").encode())  # one write: the ranks' lines never mix
    dist.barrier()


if __name__ == "__main__":
    main()
