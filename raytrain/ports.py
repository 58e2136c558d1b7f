"""Free TCP ports for the processes raytrain starts (fake Ray nodes, its own state API) and for tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` ("" = every interface) that nothing listens on right now. The port is released before
    returning: whoever binds it next must expect, rarely, to lose it to another process."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
