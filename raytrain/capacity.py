"""Whether a cluster can hold a run's workers: pure arithmetic over the nodes' resources, used before anything starts.

Ray Train places each worker as one bundle (`resources_per_worker`, plus a GPU with `use_gpu`) on one node, so what
counts is how many bundles each node holds, not the cluster's sum: two nodes of 1.5 CPUs hold two 1-CPU workers,
not three. `workers_that_fit` counts them from the nodes' *total* resources (what the cluster could ever give,
whatever runs now); a request for more than that at `min_workers` can never start on this cluster, unless an
autoscaler adds nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from raytrain.console import counted


def workers_that_fit(nodes: Iterable[Mapping[str, float]], bundle: Mapping[str, float]) -> int:
    """Pure: how many `bundle`s the `nodes` (each a resource -> amount mapping) hold, one bundle never spanning
    two nodes. A bundle asking for nothing fits without bound (returns a large number)."""
    asked = {name: amount for name, amount in bundle.items() if amount > 0}
    if not asked:
        return 2**31 - 1
    total = 0
    for node in nodes:
        total += min(math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in asked.items())
    return total


def describe_request(workers: int, bundle: Mapping[str, float]) -> str:
    """`workers` workers of {resource: amount} as one phrase, e.g. "3 workers of CPU 1"."""
    parts = ", ".join(f"{name} {amount:g}" for name, amount in sorted(bundle.items()) if amount > 0)
    return f"{counted(workers, 'worker')} of {parts or 'no resources'}"


def describe_nodes(nodes: Iterable[Mapping[str, float]], names: Iterable[str]) -> str:
    """The nodes' amounts of the resources `names`, e.g. "1 node: CPU 2"."""
    nodes = list(nodes)
    wanted = sorted(set(names))
    per_node = "; ".join(", ".join(f"{n} {node.get(n, 0):g}" for n in wanted) for node in nodes)
    return f"{counted(len(nodes), 'node')}: {per_node}"
