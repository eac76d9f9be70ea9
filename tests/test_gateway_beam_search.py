"""vLLM's beam search parameters on the HTTP API (`use_beam_search`, `best_of`,
`length_penalty`, `early_stopping`) and `pagedserve generate --beam-width`: what the gateway
refuses before calling the control plane, what it sends it, and one search end to end,
compared with the same search through gRPC and with the sequences' scores recomputed from
their prompt logprobs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from gateway.chat_completion.protocol import ChatCompletionRequest
from gateway.choices import expand_choices
from gateway.completion.protocol import CompletionRequest
from gateway.errors import APIError
from gateway.sampling import SamplingFields, beam_search_proto, sampling_proto
from pagedserve.sampling_params import InvalidRequestError
from pagedserve.wire import sampling_from_proto
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from tests.gateway_stack import GatewayStack, shared_gateway_stack

PROMPT = "The quick brown fox"
USER = [{"role": "user", "content": "Say something."}]
BEAM = {"use_beam_search": True}


def completion(**kw: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 4, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 4, **kw}


class Case(NamedTuple):
    name: str
    body: dict[str, Any]
    param: str
    path: str = "/v1/completions"
    says: str = ""  # a piece of the message


CHAT = "/v1/chat/completions"

REFUSED = [
    Case("stream", completion(**BEAM, stream=True), "stream", says="cannot stream"),
    Case("chat stream", chat(**BEAM, stream=True), "stream", CHAT, "cannot stream"),
    Case("best_of < n", completion(**BEAM, n=3, best_of=2), "best_of", says="at least n"),
    Case("best_of != n without beam search", completion(n=2, best_of=4), "best_of"),
    Case("temperature 0.5", completion(**BEAM, temperature=0.5), "temperature", says="0.5"),
    Case("chat temperature 2", chat(**BEAM, temperature=2), "temperature", CHAT),
    Case("top_k", completion(**BEAM, top_k=5), "top_k"),
    Case("top_p", completion(**BEAM, top_p=0.9), "top_p"),
    Case("min_p", completion(**BEAM, min_p=0.1), "min_p"),
    Case("repetition_penalty", completion(**BEAM, repetition_penalty=1.2), "repetition_penalty"),
    Case("presence_penalty", completion(**BEAM, presence_penalty=0.5), "presence_penalty"),
    Case("frequency_penalty", chat(**BEAM, frequency_penalty=-1), "frequency_penalty", CHAT),
    Case("logprobs", completion(**BEAM, logprobs=0), "logprobs"),
    Case("chat logprobs", chat(**BEAM, logprobs=True), "logprobs", CHAT),
    Case("chat top_logprobs", chat(**BEAM, logprobs=True, top_logprobs=2), "logprobs", CHAT),
    Case("echo + logprobs", completion(**BEAM, echo=True, logprobs=1), "logprobs"),
    Case("prompt_logprobs", completion(**BEAM, prompt_logprobs=1), "prompt_logprobs"),
    Case("stop", completion(**BEAM, stop=["fox"]), "stop"),
    Case("chat stop string", chat(**BEAM, stop="."), "stop", CHAT),
    Case("stop_token_ids", completion(**BEAM, stop_token_ids=[3]), "stop_token_ids"),
    Case("min_tokens", completion(**BEAM, min_tokens=2), "min_tokens"),
    Case("early_stopping other", completion(**BEAM, early_stopping="sometimes"), "early_stopping"),
    Case("early_stopping string", completion(**BEAM, early_stopping="true"), "early_stopping"),
    Case("early_stopping number", completion(**BEAM, early_stopping=1), "early_stopping"),
    Case("length_penalty range", completion(**BEAM, length_penalty=1e6), "length_penalty"),
    Case(  # 100 ** 200 is past float32 (and float64): scores could not be divided by it
        "length_penalty past float32 at max_tokens",
        completion(**BEAM, length_penalty=200, max_tokens=100),
        "length_penalty",
        says="within ±18.96",
    ),
    Case(
        "negative length_penalty past float32",
        chat(**BEAM, length_penalty=-30, max_tokens=30),
        "length_penalty",
        CHAT,
        "within ±25.67",
    ),
    Case("length_penalty string", completion(**BEAM, length_penalty="1"), "length_penalty"),
    Case("use_beam_search string", completion(use_beam_search="yes"), "use_beam_search"),
]


@pytest.fixture(scope="module")
def gs(pytestconfig: pytest.Config, micro_llama: Path) -> GatewayStack:
    return shared_gateway_stack(pytestconfig, micro_llama)


@pytest.fixture(scope="module")
def http(gs: GatewayStack) -> httpx.Client:
    return httpx.Client(base_url=gs.url, headers=gs.headers, timeout=120)


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_refused_before_the_control_plane(gs: GatewayStack, http: httpx.Client, case: Case) -> None:
    r = http.post(case.path, json=case.body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == case.param, error  # the control plane's errors name no param
    assert case.says in error["message"]


def _logprobs(req: SamplingFields) -> int | None:
    if isinstance(req, CompletionRequest):
        return req.logprobs
    assert isinstance(req, ChatCompletionRequest)
    return req.logprobs_k()


def _request(model: type[SamplingFields], body: dict[str, Any]) -> pb.GenerateRequest:
    """What the route sends upstream for `body` (one prompt), built as the route builds it."""
    req = model.model_validate(body)
    req.check()
    logprobs = _logprobs(req)
    sampling = sampling_proto(req, logprobs)
    beam_search_proto(req, sampling)
    base = pb.GenerateRequest(sampling=sampling)
    [choice] = expand_choices(base, req.n, 0, "r", True)
    return choice.request


def test_beam_fields_sent_upstream() -> None:
    s = _request(
        CompletionRequest,
        completion(**BEAM, n=2, best_of=4, length_penalty=0.5, early_stopping="never"),
    ).sampling
    assert (s.beam_width, s.n, s.length_penalty) == (4, 2, 0.5)
    assert s.early_stopping == common_pb2.EARLY_STOPPING_NEVER
    # Without best_of the width is n, and n sequences come back.
    s = _request(CompletionRequest, completion(**BEAM, n=3, early_stopping=True)).sampling
    assert (s.beam_width, s.n, s.HasField("length_penalty")) == (3, 3, False)
    assert s.early_stopping == common_pb2.EARLY_STOPPING_TRUE
    # Without use_beam_search, length_penalty and early_stopping are accepted and ignored.
    s = _request(CompletionRequest, completion(length_penalty=2.0, early_stopping=True)).sampling
    assert s.beam_width == 0 and not s.HasField("length_penalty")
    assert s.early_stopping == common_pb2.EARLY_STOPPING_FALSE


ACCEPTED = [
    (CompletionRequest, completion(**BEAM, n=2, best_of=4, temperature=0)),
    (CompletionRequest, completion(**BEAM, temperature=1, seed=3, ignore_eos=True, echo=True)),
    (CompletionRequest, completion(**BEAM, top_k=-1, top_p=1, stop=[], min_tokens=0)),
    (CompletionRequest, completion(**BEAM, n=16, best_of=16, length_penalty=-2)),
    (ChatCompletionRequest, chat(**BEAM, n=2)),  # temperature unset: the default, 1
    (ChatCompletionRequest, {"messages": USER, **BEAM, "best_of": 3, "logprobs": False}),
]


@pytest.mark.parametrize("model,body", ACCEPTED)
def test_accepted_requests_pass_the_control_planes_checks(
    model: type[SamplingFields], body: dict[str, Any]
) -> None:
    """What the gateway lets through with use_beam_search, SamplingParams takes too."""
    params = sampling_from_proto(_request(model, body).sampling, default_max_tokens=16)
    assert params.beam_width == body.get("best_of", body.get("n", 1))


ENGINE_CHECKED = [
    c
    for c in REFUSED
    if c.body.get("use_beam_search") is True
    and c.param not in ("stream", "best_of", "early_stopping", "length_penalty")
]


@pytest.mark.parametrize("case", ENGINE_CHECKED, ids=[c.name for c in ENGINE_CHECKED])
def test_refusals_match_the_control_plane(case: Case) -> None:
    """Each parameter the gateway refuses with beam search, SamplingParams refuses too."""
    model = ChatCompletionRequest if case.path == CHAT else CompletionRequest
    with pytest.raises(APIError):
        _request(model, case.body)
    req = model.model_validate({**case.body, "use_beam_search": False})  # past the gateway
    sampling = sampling_proto(req, _logprobs(req))
    sampling.beam_width = req.n
    with pytest.raises(InvalidRequestError, match=f"takes no {case.param}"):
        sampling_from_proto(sampling, default_max_tokens=16)


@pytest.mark.parametrize(("penalty", "max_tokens", "ok"), [(18.5, 100, True), (19.0, 100, False),
                                                     (-87.0, 2, True), (-126.0, 2, False),
                                                     (1000.0, 1, True)])  # fmt: skip
def test_the_control_plane_refuses_a_length_penalty_past_float32(
    penalty: float, max_tokens: int, ok: bool
) -> None:
    """length ** length_penalty must be a normal float32 for every length up to max_tokens,
    or a score divides by inf or 0 (`control_plane/beam.py`): refused with INVALID_ARGUMENT
    rather than failing the engine step, and every other request with it."""
    sampling = common_pb2.SamplingParams(
        beam_width=2, length_penalty=penalty, max_tokens=max_tokens
    )
    if ok:
        assert sampling_from_proto(sampling, default_max_tokens=16).length_penalty == penalty
        assert math.isfinite(float(max_tokens) ** penalty) and max_tokens**penalty > 1.2e-38
    else:
        with pytest.raises(InvalidRequestError, match="past float32's range"):
            sampling_from_proto(sampling, default_max_tokens=16)


def test_openapi_documents_the_parameters(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        assert "best_of" in props["use_beam_search"]["description"]
        assert props["length_penalty"]["default"] == 1.0
        shapes = props["early_stopping"]["anyOf"]
        assert {"type": "boolean"} in shapes and {"const": "never", "type": "string"} in shapes
    assert "best first" in schemas["CompletionChoice"]["properties"]["index"]["description"]


def test_ignored_without_use_beam_search(http: httpx.Client) -> None:
    body = completion(max_tokens=6, temperature=0, ignore_eos=True)
    plain = http.post("/v1/completions", json=body)
    tuned = http.post(
        "/v1/completions", json={**body, "length_penalty": 3.0, "early_stopping": "never"}
    )
    assert plain.status_code == tuned.status_code == 200, tuned.text
    assert tuned.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def _grpc_beams(gs: GatewayStack, prompt: str, **kw: Any) -> list[pb.GenerateResponse]:
    """The search's final messages, by completion index."""
    sampling = common_pb2.SamplingParams(**kw)
    req = pb.GenerateRequest(text=prompt, sampling=sampling)
    req.output_kind = pb.OUTPUT_KIND_FINAL_ONLY
    by_index: dict[int, pb.GenerateResponse] = {}
    for msg in gs.stack.stub.Generate(req, timeout=120):
        assert msg.index not in by_index  # one message per sequence
        by_index[msg.index] = msg
    return [by_index[i] for i in sorted(by_index)]


def _logprob_sum(gs: GatewayStack, prompt_ids: list[int], token_ids: list[int]) -> float:
    """The sum of token_ids' logprobs after prompt_ids, from a prompt-logprobs request."""
    req = pb.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    )
    req.token_ids.ids.extend(prompt_ids + token_ids)
    [first, *_] = list(gs.stack.stub.Generate(req, timeout=120))
    lps = list(first.prompt_logprobs)
    assert [lp.token_id for lp in lps] == prompt_ids + token_ids
    return sum(lp.logprob for lp in lps[len(prompt_ids) :])


def test_beam_search_end_to_end(gs: GatewayStack, http: httpx.Client) -> None:
    body = completion(**BEAM, n=2, best_of=4, max_tokens=8, temperature=0)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]

    beams = _grpc_beams(gs, PROMPT, n=2, beam_width=4, max_tokens=8, temperature=0)
    assert [m.index for m in beams] == [0, 1]
    assert [c["text"] for c in out["choices"]] == [m.text for m in beams]
    assert [c["finish_reason"] for c in out["choices"]] == [m.finish_reason for m in beams]
    for m in beams:
        assert m.finish_reason in ("stop", "length")
        assert m.completion_tokens == len(m.token_ids) <= 8
        assert m.HasField("sequence_score")
    assert beams[0].token_ids != beams[1].token_ids
    scores = [m.sequence_score for m in beams]
    assert scores == sorted(scores, reverse=True)  # best first
    assert out["usage"]["completion_tokens"] == sum(m.completion_tokens for m in beams)
    assert out["usage"]["prompt_tokens"] == beams[0].prompt_tokens

    # A sequence that ran to max_tokens scores its logprob sum / 8 (length_penalty 1).
    prompt_ids = list(gs.stack.stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)
    for m in beams:
        if m.finish_reason == "length":
            expected = _logprob_sum(gs, prompt_ids, list(m.token_ids)) / len(m.token_ids)
            assert math.isclose(m.sequence_score, expected, rel_tol=1e-3, abs_tol=1e-3)

    # The same search, through `pagedserve generate`.
    cli = [sys.executable, "-m", "pagedserve.cli", "generate", "--control-plane", gs.stack.address]
    args = ["--prompt", PROMPT, "--max-tokens", "8", "--beam-width", "4", "--n", "2"]
    as_json = subprocess.run([*cli, *args, "--json"], capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 0, as_json.stderr
    msgs = sorted(
        (json.loads(x) for x in as_json.stdout.splitlines()), key=lambda d: d.get("index", 0)
    )
    assert [[int(t) for t in d["token_ids"]] for d in msgs] == [list(m.token_ids) for m in beams]
    text = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    heads = [line for line in text.stdout.splitlines() if line.startswith("=== ")]
    assert heads == [f"=== {m.index} score={m.sequence_score:.6f}" for m in beams]


def test_chat_beam_search(http: httpx.Client) -> None:
    r = http.post(CHAT, json=chat(**BEAM, n=2, best_of=3, max_tokens=6, length_penalty=0.5))
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in out["choices"])
    assert 2 <= out["usage"]["completion_tokens"] <= 12


def test_constrained_beam_search(http: httpx.Client) -> None:
    """A choice constraint and a regex hold on every returned beam."""
    options = ["alpha", "beta", "gamma"]
    r = http.post(
        "/v1/completions",
        json=completion(**BEAM, n=2, best_of=3, max_tokens=12, guided_choice=options),
    )
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 2 and set(texts) <= set(options), texts
    r = http.post(CHAT, json=chat(**BEAM, n=2, max_tokens=8, guided_regex="[0-9]{3}"))
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert all(len(t) == 3 and t.isdigit() for t in texts), texts
