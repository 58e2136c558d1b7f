"""Parallel dimensions as data: how W workers split into pipeline stages, data-parallel replicas and tensor-parallel
groups, and the device mesh that names them.

Layout (torchtitan's `ParallelDims`, with torchft's lesson that elasticity lives on the replica axis only):

    mesh dims   ("pp", "dp", "tp")     TP innermost: the ranks of one TP group are consecutive, i.e. on one node
                                        (Ray Train hands out ranks grouped by node); PP outermost.
    rank        (pp_i * dp + dp_i) * tp + tp_i
    tp, pp      fixed by the configuration; a resize never changes them
    dp          W // (tp * pp): what changes when workers come and go

The batch plan is computed for dp (a TP group or a pipeline is one replica: it trains one share of the global batch),
data is indexed by the dp rank, and every reduction names its mesh dimension. W must be a multiple of tp * pp:
raytrain's scaling policy rounds the size Ray Train would choose down to a multiple (`raytrain.ray_hooks`), and a
start at any other size is refused by `ParallelDims.of`, naming both numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raytrain.errors import ConfigError

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Coords:
    """One rank's place in the layout: its pipeline stage, data-parallel replica and tensor-parallel shard."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """The layout of one worker-group start: `world` = pp * dp * tp ranks."""

    world: int
    tp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, world: int, tp: int = 1, pp: int = 1) -> ParallelDims:
        """The layout of `world` workers with tensor-parallel degree `tp` and `pp` pipeline stages. Raises
        `ConfigError` unless every number is a positive integer and tp * pp divides `world`."""
        for name, value in (("world size", world), ("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if world % (tp * pp):
            raise ConfigError(
                f"world size {world} is not a multiple of tp * pp = {tp} * {pp} = {tp * pp}: every data-parallel "
                f"replica needs all {tp * pp} of its workers (valid sizes: {tp * pp}, {2 * tp * pp}, ...)"
            )
        return cls(world, tp, pp)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the size the batch plan is computed for."""
        return self.world // (self.tp * self.pp)

    @property
    def replica(self) -> int:
        """Workers per data-parallel replica (tp * pp): the unit in which the world grows and shrinks."""
        return self.tp * self.pp

    @property
    def model_parallel(self) -> bool:
        """True when the model is split (tp or pp > 1): the layouts that need a device mesh."""
        return self.replica > 1

    def coords(self, rank: int) -> Coords:
        """The (pp, dp, tp) coordinates of global rank `rank` (TP innermost)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")
        return Coords(pp=rank // (self.dp * self.tp), dp=rank // self.tp % self.dp, tp=rank % self.tp)

    def rank_of(self, coords: Coords) -> int:
        """The global rank at `coords` (the inverse of `coords`)."""
        return (coords.pp * self.dp + coords.dp) * self.tp + coords.tp

    def replica_ranks(self) -> list[int]:
        """One global rank per data-parallel replica, in dp order: the first rank of each replica's first stage
        (its slice of a step's samples is the replica's)."""
        return [self.rank_of(Coords(pp=0, dp=d, tp=0)) for d in range(self.dp)]

    def describe(self) -> str:
        """The layout for log lines: "dp 2, tp 2, pp 1"."""
        return f"dp {self.dp}, tp {self.tp}, pp {self.pp}"

    def build_mesh(self, device_type: str) -> Any:
        """The `DeviceMesh` ("pp", "dp", "tp") over the default process group's ranks (a collective: every rank
        calls it). Sub-meshes: `mesh["tp"]`, `mesh["dp"]`, `mesh["pp"]`."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)


def check_tp_within_nodes(node_of_rank: Sequence[str], tp: int) -> None:
    """Raise `ConfigError` when a tensor-parallel group (ranks tp*i .. tp*i + tp - 1) spans two nodes: its
    all-reduces run in every layer's forward and backward and need the node's interconnect. `node_of_rank[r]` is
    rank r's node id (Ray Train's world ranks are grouped by node)."""
    for start in range(0, len(node_of_rank), tp):
        nodes = list(dict.fromkeys(node_of_rank[start : start + tp]))
        if len(nodes) > 1:
            raise ConfigError(
                f"tensor-parallel group of ranks {start}..{start + tp - 1} spans {len(nodes)} nodes "
                f"({', '.join(n[:8] for n in nodes)}): tp = {tp} needs each node to hold a multiple of {tp} workers "
                "(give every node a multiple of tp worker slots, or lower tp)"
            )
