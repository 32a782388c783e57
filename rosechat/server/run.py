"""Running the app under uvicorn: in the foreground (`rosechat serve`) or on a background thread
(tests, `rosechat bench serve`) on a socket bound before uvicorn starts (port 0 = a free one)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: FastAPI, log_level: str = "warning") -> uvicorn.Config:
    # A stream left open at shutdown is cut after a few seconds, so Ctrl+C always ends the server.
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, access_log=False)


@dataclass
class BackgroundServer:
    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0, grace: float | None = None) -> None:
        """Shut down; open streams get `grace` seconds (default the config's) before they are cut."""
        if grace is not None:
            self.server.config.timeout_graceful_shutdown = grace
        self.server.should_exit = True
        self.thread.join(timeout)


def start_background(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0,
                     sock: socket.socket | None = None) -> BackgroundServer:
    """``sock``: a socket bound ahead (not listening yet, so connections are refused until now)."""
    if sock is None:
        sock = bind(host, port)
    else:
        sock.listen(2048)
        host = sock.getsockname()[0]
    server = uvicorn.Server(uvicorn_config(app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rosechat-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:  # lifespan done (engine thread up): wait on the condition, bounded
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    return BackgroundServer(server, thread, host, sock.getsockname()[1])
