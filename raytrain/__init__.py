"""raytrain: an elastic distributed trainer for PyTorch on Ray (see README.md).

`import raytrain` stays light (no torch, no Ray): `raytrain.attach` (bring your own loop, `raytrain.session`),
`raytrain.ParquetSource` (Parquet files read in place, `raytrain.data.parquet`), `raytrain.export` and
`raytrain.load_model` (the trained model out, `raytrain.model_export`) are imported on first use.
"""

from typing import Any

__all__ = ["ParquetSource", "attach", "export", "load_model"]


def __getattr__(name: str) -> Any:
    if name == "attach":
        from raytrain.session import attach

        return attach
    if name in ("export", "load_model"):
        import importlib

        return getattr(importlib.import_module("raytrain.model_export"), name)
    if name == "ParquetSource":
        from raytrain.data.parquet import ParquetSource

        return ParquetSource
    raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
