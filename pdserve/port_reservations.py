"""`PortReservations`: pd-serve holds every fixed port it will use before any node starts.

    reservations = PortReservations(host)
    reservations.reserve(8000, "the router's HTTP API", "--http-port N (0: off)")
        PortTaken (its message names the port and the flag that moves it) when another
        process listens there; else the port is held (bound and listening, as a server
        would) until ...
    reservations.release([8000, 50051])   ... right before the process that serves it starts

A taken port fails pd-serve in seconds, not after the nodes loaded the model. Held, not just
probed: nobody takes it while the nodes load (a client connecting meanwhile waits in the
backlog). SO_REUSEADDR as the servers set it: a port a stopped server left in TIME_WAIT is free.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass


class PortTaken(OSError):
    """A port pd-serve needs is in use: the message says which, and how to move it."""


@dataclass(frozen=True)
class Reserved:
    port: int
    what: str  # e.g. "the router's HTTP API"
    sock: socket.socket


class PortReservations:
    def __init__(self, host: str) -> None:
        """Ports on `host` (the address pd-serve's processes listen on)."""
        self.host = host
        self._held: dict[int, Reserved] = {}

    def reserve(self, port: int, what: str, move_with: str) -> None:
        """Hold `port` for `what` (0: nothing to hold: a free port is picked later);
        PortTaken naming the port, `what` and the flag (`move_with`) otherwise."""
        if port == 0 or port in self._held:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host.strip("[]"), port))
            sock.listen(1)
        except OSError as error:
            sock.close()
            raise PortTaken(
                f"port {port} on {self.host} is taken ({error.strerror or error}), and pd-serve "
                f"needs it for {what}: stop what uses it, or move it with {move_with}"
            ) from None
        self._held[port] = Reserved(port, what, sock)

    def release(self, ports: Iterable[int]) -> None:
        """Let the processes that serve `ports` bind them (ports not held are skipped)."""
        for port in ports:
            held = self._held.pop(port, None)
            if held is not None:
                held.sock.close()

    def release_all(self) -> None:
        self.release(list(self._held))
