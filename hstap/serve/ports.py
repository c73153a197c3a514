"""Who holds a TCP port: `hstap serve` refuses a taken port up front and counts an engine ready only when its own
process tree listens on the port (another process's server answering /health is not our engine)."""

from __future__ import annotations

import errno
import socket

import psutil

from hstap.errors import HstapError


def listeners(port: int) -> list[int | None]:
    """Pids listening on `port` on any address (None: a socket whose process this user cannot see)."""
    try:
        conns = psutil.net_connections("inet")
    except (psutil.Error, OSError):
        return []
    return [c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]


def describe(pid: int | None) -> str:
    if pid is None:
        return "a process of another user"
    try:
        p = psutil.Process(pid)
        return f"pid {pid} ({p.name()}: {' '.join(p.cmdline())[:120]})"
    except psutil.Error:
        return f"pid {pid}"


def check_port_free(host: str, port: int) -> None:
    """Raise a one-line HstapError when `host:port` cannot be bound (taken, or not an address of this machine)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise HstapError(f"--host {host}: cannot resolve it ({exc})") from None
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a socket in TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                holder = ", ".join(describe(pid) for pid in listeners(port)) or "another process"
                raise HstapError(f"--port {port}: {host}:{port} is already in use by {holder}; stop that server or "
                                 "choose another --port") from None
            raise HstapError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, chosen by the OS (bind to port 0): for a server started next by a
    test or a benchmark, never a fixed port that a second run on the same machine would find taken."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
