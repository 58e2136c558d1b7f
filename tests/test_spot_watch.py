"""A cloud's spot-interruption notice becomes a Ray drain with its deadline (`raytrain.spot_watch`), against a fake
EC2 metadata server (IMDSv2) on 127.0.0.1 and a real local Ray cluster node."""

from __future__ import annotations

import datetime as dt
import http.server
import json
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import ray.cloudpickle
from ray_helpers import wait_for

from raytrain.spot_watch import interruption_deadline, watch

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules by name


class FakeIMDS(http.server.BaseHTTPRequestHandler):
    """PUT /latest/api/token gives a token; the instance-action answers 404 until `notice` is set."""

    notice: dict[str, str] | None = None

    def do_PUT(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"token-123")

    def do_GET(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
            self.send_response(401)
            self.end_headers()
            return
        if FakeIMDS.notice is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(FakeIMDS.notice).encode())

    def log_message(self, *args: object) -> None:
        pass


class Busy:
    def ping(self) -> int:
        return 1


@pytest.fixture
def imds() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), FakeIMDS)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeIMDS.notice = None
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_spot_notice_drains_the_node_with_its_deadline(imds: str, no_ray_connection: None) -> None:
    from ray._private.state import state as ray_state
    from ray.cluster_utils import Cluster

    assert interruption_deadline(imds) is None
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        node = cluster.add_node(num_cpus=1, resources={"spot": 1})
        import ray

        ray.init(address=cluster.address, log_to_driver=False)
        try:
            busy = ray.remote(resources={"spot": 1})(Busy).remote()  # the node runs something, as a worker would
            ray.get(busy.ping.remote())
            assert not watch(cluster.address, node.node_id, imds, interval_s=0.1, margin_s=10, once=True)
            when = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=120)
            FakeIMDS.notice = {"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
            assert interruption_deadline(imds) == pytest.approx(when.timestamp(), abs=1.0)
            assert watch(cluster.address, node.node_id, imds, interval_s=0.1, margin_s=10)
            draining = wait_for("the drain to show", lambda: ray_state.get_draining_nodes(), 20, 0.2)
            assert node.node_id in draining
            deadline_s = draining[node.node_id] / 1000
            assert deadline_s == pytest.approx(when.timestamp() - 10, abs=3.0)  # the notice minus the margin
            assert deadline_s > time.time() + 90
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
