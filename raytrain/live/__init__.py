"""Live recovery (`ClusterConfig(recovery="live")`): when a worker dies the others finish the step among themselves
with the same global batch and go on without restarting; a replacement joins with a peer's weights.

    replica.py   one torchft replica group's exact-batch step (pure share math: `live_share`)
    worker.py    the Ray actor of one replica: data position from the step number, rank-0 records
    log.py       the one writer of the run's files and live checkpoints (an actor on the driver's node)
    driver.py    the lighthouse, the replicas, replacements, and the fallback to a restart
"""
