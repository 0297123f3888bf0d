"""A free TCP port on this host, for a rendezvous or a process group's store."""

import socket


def free_port() -> int:
    """A port the OS just handed out and released again: free unless another process takes
    it before the caller binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
