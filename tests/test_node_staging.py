"""The CPU gather of the fused workers' weight sync (easytrain.workers.peer_memory.NodeStaging), on two real
processes with a gloo world: FSDP2 shards (uneven, one rank's empty) gathered into full tensors and into given
targets; every rank falls back together (None) when one rank has no usable /dev/shm, and nothing is left
behind in it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def run_rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from easytrain.workers import peer_memory
    from easytrain.workers.peer_memory import NodeStaging

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same full weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))  # dim 0 of 1 row: rank 1 empty
    full = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    state = model.state_dict()
    names = list(state)
    results: dict[str, object] = {}

    staging = NodeStaging.connect(need=4096)
    assert staging is not None
    gathered = staging.gather(state, names, torch.float32, {})
    results["gathered"] = all(torch.equal(gathered[n], full[n]) for n in names)
    target = torch.zeros(5, 3)
    into = staging.gather(state, names, torch.float32, {"0.weight": target})
    results["in_place"] = into["0.weight"] is target and torch.equal(target, full["0.weight"])
    results["bf16"] = torch.equal(staging.gather(state, names, torch.bfloat16, {})["0.bias"],
                                  full["0.bias"].to(torch.bfloat16))

    shared = os.path.join(out, "shm")  # rank 0 stages there; rank 1 has no such folder
    os.makedirs(shared, exist_ok=True)
    peer_memory.SHM = shared if rank == 0 else os.path.join(out, "no-such-folder")
    results["one_rank_without_shm"] = NodeStaging.connect(need=4096) is None
    dist.barrier()
    results["left_behind"] = os.listdir(shared)  # rank 0's buffer was unlinked all the same
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_node_staging_gathers_shards_and_falls_back_together(tmp_path: Path) -> None:
    mp.spawn(run_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results == {"gathered": True, "in_place": True, "bf16": True, "one_rank_without_shm": True,
                           "left_behind": []}, (rank, results)
