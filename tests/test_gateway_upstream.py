"""The gateway against a scripted control plane (an in-process gRPC server) and against none:
status mapping (429 + Retry-After, 503, 500), errors mid-stream, /health, the n > 1 fan-out on
the wire (request ids, seeds), and --served-model-name."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc
from tests.gateway_stack import HttpProcess, Processes
from tests.procs import free_port

MODEL = "fake-model"


@dataclass
class FakeControlPlane(pb_grpc.ControlPlaneServicer):
    """Answers by prompt text: "busy" -> RESOURCE_EXHAUSTED, "down" -> UNAVAILABLE, "boom" ->
    INTERNAL, "late" -> one message then INTERNAL; anything else -> two messages."""

    worker_healthy: bool = True
    seen: list[pb.GenerateRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _script(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        """The scripted answer to a request: its messages, or Scripted with its status."""
        with self.lock:
            self.seen.append(request)
        if request.model and request.model != MODEL:
            raise Scripted(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served")
        codes = {
            "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
            "down": grpc.StatusCode.UNAVAILABLE,
            "boom": grpc.StatusCode.INTERNAL,
        }
        if request.text in codes:
            raise Scripted(codes[request.text], f"scripted {request.text}")
        n = max(request.sampling.n, 1)
        for i in range(n):
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[1], text="a", prompt_tokens=3,
                completion_tokens=1, index=i,
            )  # fmt: skip
        if request.text == "late":
            raise Scripted(grpc.StatusCode.INTERNAL, "worker lost")
        for i in range(n):
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[2], text="b", prompt_tokens=3,
                completion_tokens=2, finish_reason="length", index=i, last=i == n - 1,
            )  # fmt: skip

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        try:
            yield from self._script(request)
        except Scripted as exc:
            context.abort(exc.code, exc.message)

    def GenerateMany(
        self, request_iterator: Iterator[pb.GenerateManyRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateManyResponse]:
        for msg in request_iterator:
            if msg.WhichOneof("kind") != "generate":
                continue
            batch = pb.GenerateManyResponse()
            try:
                batch.responses.extend(self._script(msg.generate))
            except Scripted as exc:
                rid = msg.generate.request_id
                batch.errors.add(request_id=rid, code=exc.code.value[0], message=exc.message)
            yield batch

    def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=MODEL, max_model_len=64)])

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(workers=[pb.WorkerStats(healthy=self.worker_healthy)])


class Scripted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Fixture:
    cp: FakeControlPlane
    health: health.HealthServicer
    gateway: HttpProcess  # serves the fake's model as "alias"
    dead: HttpProcess  # points at a port nobody listens on


@pytest.fixture(scope="module")
def fx() -> Iterator[Fixture]:
    cp = FakeControlPlane()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ControlPlaneServicer_to_server(cp, server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    procs = Processes()
    try:
        gw = procs.gateway(f"127.0.0.1:{port}", "--served-model-name", "alias")
        dead = procs.gateway(f"127.0.0.1:{free_port()}")
        yield Fixture(cp, hs, gw, dead)
    finally:
        procs.stop_all()
        server.stop(grace=None)


def post(url: str, prompt: str, **kw: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **kw}, timeout=10)


@pytest.mark.parametrize(
    "prompt,status,retry_after",
    [("busy", 429, True), ("down", 503, True), ("boom", 500, False)],
)
def test_upstream_status_mapping(fx: Fixture, prompt: str, status: int, retry_after: bool) -> None:
    for stream in (False, True):  # a stream that fails before its first token is an HTTP error
        r = post(fx.gateway.url, prompt, stream=stream)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert ("retry-after" in r.headers) == retry_after
    if status == 429:
        client = openai.OpenAI(base_url=f"{fx.gateway.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="alias", prompt="busy")


def test_error_mid_stream_is_an_event(fx: Fixture) -> None:
    r = post(fx.gateway.url, "late", stream=True)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["message"] == "worker lost"
    assert events[-1] == "[DONE]"
    client = openai.OpenAI(base_url=f"{fx.gateway.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="worker lost"):
        list(client.completions.create(model="alias", prompt="late", stream=True))


def test_n_is_one_upstream_request(fx: Fixture) -> None:
    fx.cp.seen.clear()
    r = httpx.post(
        f"{fx.gateway.url}/v1/completions",
        json={"prompt": "ok", "n": 3, "seed": 5, "model": "alias"},
        headers={"x-request-id": "fan"},
    )
    assert r.status_code == 200
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "ab" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    # One upstream request: the control plane forks the n completions.
    [q] = fx.cp.seen
    assert (q.request_id, q.sampling.n, q.sampling.seed) == ("fan", 3, 5)
    assert q.model == "" and q.text == "ok" and q.add_special_tokens


def test_served_model_name(fx: Fixture) -> None:
    models = httpx.get(f"{fx.gateway.url}/v1/models").json()["data"]
    assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [("alias", MODEL, 64)]
    assert post(fx.gateway.url, "ok", model="alias").json()["model"] == "alias"
    assert post(fx.gateway.url, "ok").json()["model"] == "alias"
    r = post(fx.gateway.url, "ok", model=MODEL)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_health_follows_control_plane_and_workers(fx: Fixture) -> None:
    url = f"{fx.gateway.url}/health"
    assert httpx.get(url).status_code == 200
    fx.cp.worker_healthy = False
    try:
        assert httpx.get(url).status_code == 503
    finally:
        fx.cp.worker_healthy = True
    fx.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert httpx.get(url).status_code == 503
    finally:
        fx.health.set("", health_pb2.HealthCheckResponse.SERVING)
    assert httpx.get(url).status_code == 200


def test_no_control_plane(fx: Fixture) -> None:
    assert httpx.get(f"{fx.dead.url}/health").status_code == 503
    for path in ("/v1/models", "/v1/completions"):
        r = httpx.request(
            "POST" if "compl" in path else "GET", fx.dead.url + path, json={"prompt": "x"}
        )
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    metrics = httpx.get(f"{fx.dead.url}/metrics")
    assert metrics.status_code == 200
    assert 'pagedserve:control_plane_up{model_name=""} 0.0' in metrics.text


def test_gateway_never_imports_torch() -> None:
    code = (
        "import sys; from pagedserve.cli.main import build_parser; import gateway.server; "
        "build_parser(); sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
