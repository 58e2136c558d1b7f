"""raytrain: an elastic distributed trainer for PyTorch on Ray (see README.md).

`import raytrain` stays light (no torch, no Ray); `raytrain.attach` (bring your own loop, `raytrain.session`) is
imported on first use.
"""

from typing import Any

__all__ = ["attach"]


def __getattr__(name: str) -> Any:
    if name == "attach":
        from raytrain.session import attach

        return attach
    raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
