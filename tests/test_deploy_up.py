"""`pagedserve up` as a user runs it: redis-server, a worker, the control plane and the gateway
come up; the README's curl example works against the printed URL; Ctrl-C lets a request in
flight finish, then every process is gone."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.procs import drain, free_port, read_until

ROOT = Path(__file__).resolve().parents[1]


def readme_curl() -> list[str]:
    """The first curl command in the README's "Try it" section, as argv."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Try it") :]
    block = re.search(r"```bash\n(curl .*?)\n```", section, flags=re.DOTALL)
    assert block is not None, "no curl example in the README's Try it section"
    return shlex.split(block[1].replace("\\\n", " "))


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_up_serves_the_readme_example_and_drains(micro_llama: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable, "-m", "pagedserve.cli", "up", "--model", str(micro_llama),
        "--port", str(http_port), "--grpc-port", str(grpc_port),
        "--worker-base-port", str(free_port()), "--kv-cache-memory", "32MiB",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        lines += read_until(proc, "pagedserve is up", 120)
        url = f"http://127.0.0.1:{http_port}"
        assert any(f"pagedserve is up: {url}" in x for x in lines), "".join(lines)[-3000:]
        assert any(x.lstrip().startswith("redis |") for x in lines), "redis-server not started"
        drain(proc, lines)

        def healthcheck(*args: str) -> int:
            cmd = [sys.executable, "-m", "pagedserve.cli", "healthcheck", *args]
            return subprocess.run(cmd, capture_output=True, timeout=30).returncode

        assert healthcheck("--http", f"{url}/health") == 0
        assert healthcheck("--grpc", f"127.0.0.1:{grpc_port}") == 0

        curl = [a.replace("http://127.0.0.1:8000", url) for a in readme_curl()]
        out = subprocess.run(curl, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["object"] in ("chat.completion", "text_completion")
        assert body["usage"]["completion_tokens"] >= 1

        # A stream in flight when Ctrl-C arrives still runs to its end.
        events: list[str] = []
        request = {"prompt": "Hello", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=60) as r:
            it = r.iter_lines()
            events.append(next(it))
            proc.send_signal(signal.SIGINT)
            events.extend(it)
        data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert [e for e in events if e][-1] == "data: [DONE]"
        assert data[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines)
    assert "gateway |" in log and "control-plane |" in log
    # The gateway stopped before the control plane: nothing failed upstream during the drain.
    assert "upstream_error" not in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
    assert healthcheck("--grpc", f"127.0.0.1:{grpc_port}", "--timeout", "0.5") == 1
