"""Data parallel evaluation: the ranks of an ``accelerate launch`` (or any torch.distributed group)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List

import torch


@dataclass
class Dist:
    """Rank/world of this process, its share of the work and the collectives the evaluation needs, through
    accelerate (no-ops for one process)."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def detect(cls) -> "Dist":
        """The current process group; under ``accelerate launch`` (``WORLD_SIZE`` > 1) it is initialized
        through ``accelerate.PartialState(cpu=True)`` (gloo on CPU)."""
        import torch.distributed as td
        if not td.is_available():
            return cls()
        if not td.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState
            PartialState(cpu=not torch.cuda.is_available())
        if td.is_initialized():
            return cls(td.get_rank(), td.get_world_size())
        return cls()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def split(self, items: list) -> list:
        """This rank's share of ``items``, contiguous and in order (accelerate's ``split_between_processes``: the
        first ``len(items) % world`` ranks get one more)."""
        if self.world == 1:
            return list(items)
        from accelerate import PartialState
        with PartialState().split_between_processes(list(items)) as mine:
            return list(mine)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place (accelerate's ``reduce``)."""
        if self.world > 1:
            from accelerate.utils import reduce
            t.copy_(reduce(t, reduction="sum"))
        return t

    def per_rank(self, value: float) -> List[float]:
        """Every rank's ``value`` (as a list indexed by rank), on every rank (accelerate's ``gather_object``)."""
        if self.world == 1:
            return [float(value)]
        from accelerate.utils import gather_object
        return [float(v) for v in gather_object([float(value)])]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td
            td.barrier()

    def close(self) -> None:
        """Destroys the process group (after a barrier). Left for interpreter exit, gloo's teardown sometimes
        aborted a rank after its work was done ("terminate called without an active exception", exit -6)."""
        import torch.distributed as td
        if self.world > 1 and td.is_available() and td.is_initialized():
            td.barrier()
            td.destroy_process_group()

    def __repr__(self) -> str:
        return f"Dist(rank={self.rank}, world={self.world})"
