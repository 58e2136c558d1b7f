"""How many workers a cluster's nodes hold (pure)."""

from __future__ import annotations

from raytrain.capacity import describe_nodes, describe_request, workers_that_fit


def test_bundles_never_span_nodes() -> None:
    assert workers_that_fit([{"CPU": 2.0}], {"CPU": 1.0}) == 2
    assert workers_that_fit([{"CPU": 1.5}, {"CPU": 1.5}], {"CPU": 1.0}) == 2  # not 3: a worker is on one node
    assert workers_that_fit([{"CPU": 4.0, "GPU": 1.0}], {"CPU": 1.0, "GPU": 1.0}) == 1
    assert workers_that_fit([{"CPU": 4.0}], {"CPU": 1.0, "worker_slot": 1.0}) == 0  # a resource no node has
    assert workers_that_fit([{"CPU": 0.3}] * 10, {"CPU": 0.1}) == 30  # float amounts counted exactly
    assert workers_that_fit([], {"CPU": 1.0}) == 0
    assert workers_that_fit([{"CPU": 1.0}], {"CPU": 0.0}) > 10**6


def test_the_phrases_name_the_request_and_the_nodes() -> None:
    assert describe_request(3, {"CPU": 1.0, "GPU": 0.0}) == "3 workers of CPU 1"
    assert describe_nodes([{"CPU": 2.0, "memory": 1e9}], ["CPU"]) == "1 node: CPU 2"
    assert describe_request(1, {"CPU": 2.0}) == "1 worker of CPU 2"
    assert describe_nodes([{"CPU": 1.0}, {"CPU": 1.0}], ["CPU"]).startswith("2 nodes: ")
