"""A real redis-server process on a free port, which tests can kill and restart."""

from __future__ import annotations

import shutil
import subprocess
import time

import redis

from tests.procs import free_port


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.exe = exe
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)
