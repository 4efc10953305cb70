"""Several processes through `torchrun`: DistributedDataParallel over NCCL (GPU) or gloo (CPU).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; without them the
run is a single process and nothing here talks to a process group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elmo_pipeline.runtime import resolve_device


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over all processes."""
        return self._all_reduce(values, dist.ReduceOp.SUM) if self.enabled else list(values)

    def max(self, value: float) -> float:
        return self._all_reduce([value], dist.ReduceOp.MAX)[0] if self.enabled else value

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        # float64 so that token counts stay exact; NCCL reduces only tensors on the GPU
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def close(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


def process_rank() -> int:
    """This process's rank as torchrun set it, 0 without torchrun: the process that speaks for
    the run (its log lines, and the one result a command prints)."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(device: str = "auto") -> DistContext:
    """Join the torchrun process group when launched by torchrun, else a 1-process context."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = process_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return DistContext(0, 1, 0, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    here = False
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        here = True
    return DistContext(rank, world, local_rank, dev, here)
