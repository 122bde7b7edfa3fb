"""The port workers see as MASTER_PORT, chosen before anything starts."""

from __future__ import annotations

import socket

from xlaunch.plan.options import DEFAULT_MASTER_ADDR as LOOPBACK  # one machine meets here


def choose_port(use_port: str | int, is_default: bool, master_addr: str, *, loopback: bool,
                owner: bool) -> int:
    """The port to use: the given one when free; a free one when the default is taken on one node.

    ``is_default``: the caller left ``use_port`` at its default (the plan's ``port_fallback``,
    known from the argument itself, not from its value). A port the caller named that is taken,
    the default's number "29500" included, is an error naming it. Only node 0 (``owner``) listens
    there; other nodes take the port they were given.
    """
    port = int(use_port)
    if not owner:
        return port
    # With several nodes the engine's store listens on every interface of node 0.
    host = LOOPBACK if loopback else ""
    if port_free(host, port):
        return port
    if is_default and loopback:
        return free_port(host)
    raise RuntimeError(
        f"port {port} on {host or master_addr} is already in use (use_port={str(use_port)!r}): "
        "another launch or program holds it. Pass another use_port"
        + (", or leave use_port out: left at its default, a taken port is replaced by a free one."
           if loopback else "."))


def port_free(host: str, port: int) -> bool:
    """Whether a listener can bind ``port`` now. With SO_REUSEADDR, as torch's store listener
    binds: a port whose last connections wait in TIME-WAIT (a launch that just ended) is free
    for it; a port another socket listens on is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK if host == "localhost" else host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
