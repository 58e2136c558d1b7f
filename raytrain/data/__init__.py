"""The data paths: every sample once per epoch, in an order defined by (seed, epoch) and the global sample offset.

- `parquet`: the default, Parquet files read in place by each rank (footers indexed on the driver).
- `materialized`: a Ray dataset materialized once; also the step helpers every path shares.
- `streaming`: `deterministic=False`, Ray Data shards with consumed ids kept exactly once.
- `sample_order` and `id_ranges`: the pure order and id-set math they use.
"""
