"""Live recovery (`ClusterConfig(recovery="live")`): when a worker dies the others finish the step among themselves
with the same global batch and go on without restarting; a replacement joins with a peer's weights.

    replica.py   one torchft replica group's exact-batch step (pure share math: `live_share`)
    worker.py    the Ray actor of one replica: data position from the step number, rank-0 records
    log.py       the one writer of the run's files and live checkpoints (an actor on the driver's node)
    driver.py    the lighthouse, the replicas, replacements, and the fallback to a restart
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain.errors import ConfigError

if TYPE_CHECKING:
    from raytrain.config import TrainSpec


def describe_groups(spec: TrainSpec) -> str:
    """Pure: a live run's replica groups in words, for the driver's start line and `raytrain fit --dry-run`: how
    many (at most, and at least), and their workers when a group has several (dp_shard sharding the model, tp
    splitting its layers)."""
    shard, tp, group = spec.parallel.dp_shard, spec.parallel.degrees[0], spec.parallel.live_group
    most, least = spec.cluster.max_workers // group, spec.cluster.min_workers // group
    if group == 1:
        return f"{most} torchft replica groups of one worker (min {least})"
    parts = []
    if shard > 1:
        parts.append(f"dp_shard={shard} sharding the model with {spec.loop.strategy}")
    if tp > 1:
        parts.append(f"tp={tp} splitting its layers")
    kind = " (HSDP)" if shard > 1 else ""
    return f"{most} torchft replica groups of {group} workers: {' x '.join(parts)}{kind} (min {least})"


def require_torchft() -> None:
    """`ConfigError` saying how to install torchft (the `live` extra) unless it imports; call before any worker
    starts. Quiets torchft's native logging first unless RAYTRAIN_VERBOSE=1 (its lighthouse logs every quorum)."""
    import os

    from raytrain.console import verbose

    if not verbose():
        os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            'ClusterConfig(recovery="live") needs torchft: pip install "raytrain[live]" (torchft >= 0.2; from a '
            "checkout: pip install -e '.[live]')"
        ) from err
