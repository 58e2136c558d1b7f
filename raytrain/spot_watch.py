"""Turn a cloud's spot-interruption notice into a Ray drain, so training loses no step when a spot node goes.

    python -m raytrain.spot_watch [--address 127.0.0.1:6379] [--interval 5] [--margin 10]

Runs on every spot worker node (`cluster.yaml` starts it beside `ray start`). It polls the instance metadata
service; when EC2 announces an interruption (`/latest/meta-data/spot/instance-action` answers with an action and
a time, two minutes ahead) it asks Ray's GCS to drain this node with that deadline, minus `--margin` seconds.
Ray Train's preemption watcher then tells the workers, raytrain commits a checkpoint and trains nothing more, and
the worker group restarts without the node from exactly that step (`raytrain.worker_loop`).

EC2's token-based metadata protocol (IMDSv2) is used: PUT /latest/api/token, then GET with the token. `--imds`
points elsewhere (the tests run a fake metadata server on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
import urllib.error
import urllib.request

IMDS = "http://169.254.169.254"
ACTION_PATH = "/latest/meta-data/spot/instance-action"


def interruption_deadline(imds: str = IMDS, timeout_s: float = 2.0) -> float | None:
    """The UNIX time at which the cloud will stop this instance, or None when no interruption is announced."""
    token_request = urllib.request.Request(
        f"{imds}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    with urllib.request.urlopen(token_request, timeout=timeout_s) as response:
        token = response.read().decode()
    request = urllib.request.Request(f"{imds}{ACTION_PATH}", headers={"X-aws-ec2-metadata-token": token})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            notice = json.loads(response.read())
    except urllib.error.HTTPError as err:
        if err.code == 404:  # no interruption scheduled
            return None
        raise
    when = dt.datetime.fromisoformat(str(notice["time"]).replace("Z", "+00:00"))
    return when.timestamp()


def watch(gcs_address: str, node_id: str, imds: str, interval_s: float, margin_s: float, once: bool = False) -> bool:
    """Poll until an interruption is announced, then drain `node_id` with its deadline; True when drained."""
    from raytrain.ray_hooks import drain_node

    while True:
        try:
            deadline = interruption_deadline(imds)
        except (OSError, ValueError, KeyError):
            deadline = None  # the metadata service is unreachable or answers nonsense: keep watching
        if deadline is not None:
            drain_node(gcs_address, node_id, max(0.0, deadline - time.time() - margin_s), "spot interruption")
            print(f"[raytrain] spot interruption at {deadline:.0f}: node {node_id[:8]} drained", flush=True)
            return True
        if once:
            return False
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m raytrain.spot_watch`: watch this node (the Ray node running on this machine)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:6379", help="the cluster's GCS address")
    parser.add_argument("--node-id", default=None, help="the Ray node to drain (default: this machine's)")
    parser.add_argument("--imds", default=IMDS, help="the instance metadata service")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    parser.add_argument("--margin", type=float, default=10.0, help="seconds of the notice kept for the restart")
    args = parser.parse_args(argv)
    node_id = args.node_id
    if node_id is None:
        import ray

        ray.init(address=args.address, log_to_driver=False)
        node_id = ray.get_runtime_context().get_node_id()
        ray.shutdown()
    watch(args.address, node_id, args.imds, args.interval, args.margin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
