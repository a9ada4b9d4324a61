"""A stack talks only to engines it started: ports are checked before anything starts, and
the engine that answers on a port must be the process ``up`` launched."""

from __future__ import annotations

import errno
import socket

import psutil

from embedserve.settings_errors import ConfigError


class PortInUse(Exception):
    """Another process listens where this stack must; ``up`` exits 2 with this sentence."""


#: The settings naming each side's address, for the sentence about a host that cannot listen.
HOST_SETTING = {"gateway": "EMBEDSERVE_GATEWAY__HOST (--host)", "engine": "EMBEDSERVE_ENGINE__HOST"}


def check_free(host: str, port: int, what: str, flag: str, variable: str) -> None:
    """Raise ``PortInUse`` when something already listens on ``host:port``, and a
    ``ConfigError`` naming the setting when ``host`` is no address of this machine or the
    port needs privileges this process lacks."""
    host_setting = HOST_SETTING.get(what, "the host")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except socket.gaierror as exc:
            raise ConfigError(
                f"{host_setting} must be an address of this machine or a name that resolves to one "
                f"(0.0.0.0 for every interface, 127.0.0.1 for this machine alone), got {host!r} "
                f"({exc.strerror})"
            ) from exc
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"{host_setting} must be an address of this machine (0.0.0.0 for every interface, "
                    f"127.0.0.1 for this machine alone), got {host!r}, which is not one of its addresses"
                ) from exc
            if exc.errno == errno.EACCES:
                raise ConfigError(
                    f"{variable} ({flag}) must be a port this process may listen on (1024 or above "
                    f"without root), got {port}"
                ) from exc
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(
                    f"{what} port {port} on {host} is already in use ({exc.strerror}); "
                    f"choose another with {flag} or {variable}"
                ) from exc
            raise ConfigError(
                f"the {what} cannot listen on {host}:{port} ({exc.strerror}): check {host_setting} "
                f"and {variable} ({flag})"
            ) from exc


def listener_pids(port: int) -> set[int | None]:
    """Processes listening on ``port`` (None for one this user may not inspect)."""
    return {
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }


def family(pid: int) -> set[int]:
    """The process and all its descendants (SGLang serves HTTP from a child)."""
    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def check_owner(port: int, pid: int, name: str) -> None:
    """Raise ``PortInUse`` unless the process listening on ``port`` is ``pid`` or its child."""
    listeners = listener_pids(port)
    if listeners & family(pid):
        return
    who = ", ".join(f"pid {p}" if p else "another user's process" for p in listeners) or "nobody"
    raise PortInUse(
        f"engine port {port} answers, but not from the engine embedserve started ({name}, pid {pid}; "
        f"listening: {who}); choose another port with --engine-port or EMBEDSERVE_ENGINE__PORT"
    )
