"""Large request bodies do not stall other requests' streams: a real gateway process streams
one client's tokens from a scripted control plane (one every 10 ms) while other clients send
bodies of millions of token ids and tens of thousands of messages. Parsing and validating
them used to run on the event loop, a gap of seconds in the stream; and a prompt longer than
any context is refused by its count before its ids are walked."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from tests.gateway_stack import HttpProcess, Processes
from tests.paced_control_plane import PacedServer

# Wall-clock bounds: run alone (`make test` runs these after the rest).
pytestmark = pytest.mark.serial

MAX_PROMPT_TOKEN_IDS = 1 << 20


@dataclass
class Fixture:
    server: PacedServer
    gateway: HttpProcess


@pytest.fixture(scope="module")
def fx() -> Iterator[Fixture]:
    server = PacedServer()
    procs = Processes()
    try:
        yield Fixture(server, procs.gateway(server.address, "--served-model-name", "m"))
    finally:
        procs.stop_all()
        server.stop()


def ids_body(count: int) -> bytes:
    """A completion whose prompt is `count` token ids, 2 bytes each: 2 M of them fill 4 MB."""
    return b'{"prompt":[' + b",".join([b"1"] * count) + b'],"max_tokens":1}'


def chat_body(count: int) -> bytes:
    messages = [{"role": "user", "content": "hi"}] * count
    return json.dumps({"messages": messages, "max_tokens": 1}).encode()


class Stream:
    """A streamed completion read in a thread, each event's arrival time kept."""

    def __init__(self, url: str) -> None:
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        body = {"prompt": "paced", "stream": True, "max_tokens": 200_000}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.times.append(time.monotonic())
                if self.stop.is_set():
                    return

    def wait_for(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < count:
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.01)

    def largest_gap(self, start: float, end: float) -> float:
        times = [t for t in self.times if start <= t <= end]
        assert len(times) > 2, "no events in the window"
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def post_all(url: str, bodies: dict[str, bytes]) -> tuple[dict[str, int], float]:
    """Every body posted at once, each on its own connection: (status by name, seconds)."""

    def post(item: tuple[str, bytes]) -> tuple[str, int]:
        name, body = item
        path = "/v1/chat/completions" if "messages" in name else "/v1/completions"
        headers = {"Content-Type": "application/json"}
        r = httpx.post(f"{url}{path}", content=body, headers=headers, timeout=120)
        return name, r.status_code

    start = time.monotonic()
    with ThreadPoolExecutor(len(bodies)) as pool:
        statuses = dict(pool.map(post, bodies.items()))
    return statuses, time.monotonic() - start


def test_large_bodies_leave_other_streams_alone(fx: Fixture) -> None:
    # Built before the stream starts: the test's own work must not show in its gaps.
    large = {
        "2 M token ids (4 MB)": ids_body(2_000_000),
        **{f"750 k token ids (1.5 MB) #{i}": ids_body(750_000) for i in range(6)},
        "65,536 messages": chat_body(65_536),
    }
    # As many small requests: what handling that many at once costs the stream on this
    # machine, now (a loaded machine stretches every gap).
    small = {name: chat_body(1) if "messages" in name else ids_body(3) for name in large}
    stream = Stream(fx.gateway.url)
    try:
        stream.wait_for(20)
        gaps = {}
        for kind, bodies in (("small", small), ("large", large)):
            time.sleep(0.5)
            start = time.monotonic()
            statuses, took = post_all(fx.gateway.url, bodies)
            time.sleep(0.5)  # a gap that ends after the last answer counts too
            gaps[kind] = stream.largest_gap(start, time.monotonic())
            print(f"{kind} bodies: {took:.1f} s, the stream's largest gap {gaps[kind]:.3f} s")
    finally:
        stream.close()
    # One event every 10 ms. Before, the large bodies were parsed on the event loop, one
    # after another: the stream waited 3.5 s (each 750 k list ~0.5 s, the chat ~1 s, the 4 MB
    # list ~1.5 s); now about as long as for the small ones (50-200 ms on two cores).
    bound = max(1.0, 3 * gaps["small"])
    assert gaps["large"] < bound, f"a gap of {gaps['large']:.2f} s while large bodies parsed"
    assert statuses.pop("2 M token ids (4 MB)") == 400  # longer than any context
    assert set(statuses.values()) == {200}, statuses


def test_prompt_longer_than_any_context_is_refused_by_its_count(fx: Fixture) -> None:
    r = httpx.post(
        f"{fx.gateway.url}/v1/completions",
        content=ids_body(MAX_PROMPT_TOKEN_IDS + 1),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert str(MAX_PROMPT_TOKEN_IDS) in error["message"], error
    # In a batch, each prompt counts on its own.
    over = b",".join([b"1"] * (MAX_PROMPT_TOKEN_IDS + 1))
    r = httpx.post(
        f"{fx.gateway.url}/v1/completions",
        content=b'{"prompt":[[1,2],[' + over + b']],"max_tokens":1}',
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    # Detokenize takes token ids too.
    r = httpx.post(
        f"{fx.gateway.url}/detokenize",
        content=b'{"tokens":[' + b",".join([b"1"] * (MAX_PROMPT_TOKEN_IDS + 1)) + b"]}",
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tokens"


def test_too_many_messages_are_refused_by_their_count(fx: Fixture) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(
            f"{fx.gateway.url}{path}",
            content=chat_body(65_537),
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages"
        assert "65536" in error["message"], error
