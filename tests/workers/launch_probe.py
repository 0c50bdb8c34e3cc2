"""Worker (torchrun or tests/workers/forklaunch.py, any rank count): prints one JSON line per rank
with what a rank sees of its launch (torchrun's variables, argv, sys.path[0], __name__), then
joins a gloo barrier. ``fail=R:CODE``: rank R exits CODE at once while the others sleep (the
launcher must end them).

    torchrun --nproc_per_node=N tests/workers/launch_probe.py [fail=R:CODE]
"""

import json
import os
import sys
import time

VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_SIGNALS_TO_HANDLE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "OMP_NUM_THREADS")


def main() -> None:
    rank = int(os.environ["RANK"])
    fail = dict(a.split("=", 1) for a in sys.argv[1:]).get("fail")
    if fail is not None:
        who, code = map(int, fail.split(":"))
        if rank == who:
            sys.exit(code)
        time.sleep(120)  # ended by the launcher, not by this
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://: rank 0's TCPStore at MASTER_ADDR:MASTER_PORT
    seen = {k: os.environ.get(k) is not None and (os.environ[k] if k != "TORCHELASTIC_RUN_ID" else "set")
            for k in VARS}
    line = json.dumps({"vars": seen, "argv": sys.argv, "path0": sys.path[0], "name": __name__,
                       "world": dist.get_world_size(), "port_set": bool(os.environ.get("MASTER_PORT"))})
    os.write(1, (line + "\n").encode())  # one write: the ranks share the pipe
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
