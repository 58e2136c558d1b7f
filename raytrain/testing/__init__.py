"""Helpers for raytrain's own tests and benchmarks (not used by training): `multiprocess.run_world`, the one
harness that runs a function on W real processes joined in a torch.distributed process group."""
