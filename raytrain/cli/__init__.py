"""The `raytrain` command (`main`: plan, demo, fit) and what only it uses: the TOML job format (`fit_config`), the
fake-node demo (`demo`) and the one-machine autoscaler the demo's `--autoscale` runs (`local_autoscaler`)."""
