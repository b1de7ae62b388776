"""The address a server listens on: bound here so that one in use is refused up front, with the
address in the message, rather than after the model has loaded (or, for the elastic server,
after Ray, Serve and the model are up and its ingress tries to listen)."""

from __future__ import annotations

import socket


class AddressUnavailable(OSError):
    """`host:port` cannot be listened on here (in use, or not an address of this machine)."""


def bind_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (the caller listens on it); `AddressUnavailable` names it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server rebinds at once
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise AddressUnavailable(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def check_address_free(host: str, port: int) -> None:
    """Raise `AddressUnavailable` unless host:port can be listened on now."""
    bind_address(host, port).close()
