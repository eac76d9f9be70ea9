"""Malformed and hostile requests against the real stack: each gets the right 4xx in OpenAI's
error shape, and a valid request right after still succeeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from tests.gateway_stack import GatewayStack, shared_gateway_stack

LONG_PROMPT = "hello world " * 2000  # well past the 2048-token context


class Case(NamedTuple):
    name: str
    status: int
    body: Any = None  # JSON body, or raw bytes
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict[str, str] | None = None  # replaces the auth header when given
    param: str | None = None


def completion(**kw: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 4, **kw}


def chat(messages: Any, **kw: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 4, **kw}


USER = [{"role": "user", "content": "hi"}]

CASES = [
    Case("invalid json", 400, b'{"prompt": "hi", '),
    Case("not utf-8", 400, b'{"prompt": "\xff\xfe caf\xe9"}'),
    Case("lone surrogate", 400, b'{"prompt": "\\ud800 hi"}'),
    Case("NaN temperature", 400, b'{"prompt": "hi", "temperature": NaN}'),
    Case("10 MB body", 413, json.dumps(completion(prompt="x" * (10 << 20))).encode()),
    Case("empty body", 400, b""),
    Case("array body", 400, [1, 2, 3]),
    Case("missing prompt", 400, {"max_tokens": 4}, param="prompt"),
    Case("prompt wrong type", 400, completion(prompt=5), param="prompt"),
    Case("prompt mixed list", 400, completion(prompt=["a", 1])),
    Case("empty prompt", 400, completion(prompt="")),
    Case("empty prompt list", 400, completion(prompt=[])),
    Case("token id past vocab", 400, completion(prompt=[1, 2, 99999])),
    Case("negative token id", 400, completion(prompt=[1, -2])),
    Case("prompt longer than context", 400, completion(prompt=LONG_PROMPT)),
    Case("negative max_tokens", 400, completion(max_tokens=-1), param="max_tokens"),
    Case("zero max_tokens", 400, completion(max_tokens=0), param="max_tokens"),
    Case("huge max_tokens", 400, completion(max_tokens=10**12), param="max_tokens"),
    Case("max_tokens past context", 400, completion(max_tokens=5000)),
    Case("max_tokens as string", 400, completion(max_tokens="4"), param="max_tokens"),
    Case("temperature < 0", 400, completion(temperature=-0.5), param="temperature"),
    Case("top_p > 1", 400, completion(top_p=1.5), param="top_p"),
    Case("top_p = 0", 400, completion(top_p=0), param="top_p"),
    Case("top_p 0 in float32", 400, completion(top_p=1e-300), param="top_p"),
    Case(
        "repetition_penalty 0 in float32",
        400,
        completion(repetition_penalty=1e-60),
        param="repetition_penalty",
    ),
    Case("presence_penalty > 2", 400, completion(presence_penalty=3), param="presence_penalty"),
    Case("n = 0", 400, completion(n=0), param="n"),
    Case("n too large", 400, completion(n=10_000), param="n"),
    Case("logprobs too many", 400, completion(logprobs=50), param="logprobs"),
    Case("empty stop string", 400, completion(stop=[""])),
    Case("negative seed", 400, completion(seed=-1), param="seed"),
    Case("min_tokens > max_tokens", 400, completion(min_tokens=9), param="min_tokens"),
    Case("stream_options without stream", 400, completion(stream_options={"include_usage": True})),
    Case(
        "streamed prompt_logprobs",
        400,
        completion(prompt_logprobs=1, stream=True),
        param="prompt_logprobs",
    ),
    Case("prompt_logprobs > 20", 400, completion(prompt_logprobs=21), param="prompt_logprobs"),
    Case("best_of != n", 400, completion(best_of=3), param="best_of"),
    Case("stream as string", 400, completion(stream="yes"), param="stream"),
    Case("unknown model", 404, completion(model="gpt-5")),
    Case("no api key", 401, completion(), headers={}),
    Case("wrong api key", 401, completion(), headers={"Authorization": "Bearer nope"}),
    Case("not a bearer key", 401, completion(), headers={"Authorization": "Basic dGVzdC1rZXk="}),
    Case("chat: no messages", 400, chat([]), "/v1/chat/completions", param="messages"),
    Case("chat: bad role", 400, chat([{"role": "wizard", "content": "x"}]), "/v1/chat/completions"),
    Case(
        "chat: image part",
        400,
        chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "/v1/chat/completions",
        param="messages.0.content.0.type",
    ),
    Case("chat: messages not a list", 400, chat("hi"), "/v1/chat/completions", param="messages"),
    Case(
        "chat: top_logprobs without logprobs",
        400,
        chat(USER, top_logprobs=2),
        "/v1/chat/completions",
        param="top_logprobs",
    ),
    Case("chat: tools", 400, chat(USER, tools=[{"type": "function"}]), "/v1/chat/completions"),
    Case(
        "body nested 960 deep", 400, ('{"prompt":"hi","x":' + "[" * 960 + "]" * 960 + "}").encode()
    ),
    Case(
        "guided_json nested 3000 deep", 400, completion(guided_json="[" * 3000), param="guided_json"
    ),
    Case(
        "guided_json with an escaped lone surrogate",
        400,
        completion(guided_json='{"const": "\\ud800"}'),
        param="guided_json",
    ),
    Case(
        "tool parameters nested 956 deep",
        400,
        (
            '{"messages":[{"role":"user","content":"x"}],"tool_choice":"required","tools":[{"type":'
            '"function","function":{"name":"f","parameters":{"type":"object","default":'
            + "[" * 956
            + "]" * 956
            + "}}}]}"
        ).encode(),
        "/v1/chat/completions",
    ),
    Case("wrong method", 405, None, method="GET"),
    Case("unknown route", 404, {}, path="/v1/engines"),
]


@pytest.fixture(scope="module")
def gs(pytestconfig: pytest.Config, micro_llama: Path) -> GatewayStack:
    return shared_gateway_stack(pytestconfig, micro_llama)


@pytest.fixture(scope="module")
def http() -> httpx.Client:
    return httpx.Client(timeout=30)


def test_enough_cases() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request(gs: GatewayStack, http: httpx.Client, case: Case) -> None:
    headers = dict(gs.headers if case.headers is None else case.headers)
    kw: dict[str, Any] = {}
    if isinstance(case.body, bytes):
        kw["content"] = case.body
        headers["Content-Type"] = "application/json"
    elif case.body is not None:
        kw["json"] = case.body
    r = http.request(case.method, gs.url + case.path, headers=headers, **kw)
    assert r.status_code == case.status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if case.param is not None:
        assert error["param"] == case.param
    assert r.headers["x-request-id"]
    if case.status == 401:
        assert error["code"] == "invalid_api_key"
    ok = http.post(f"{gs.url}/v1/completions", headers=gs.headers, json=completion(max_tokens=2))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def test_tool_call_arguments_nested_past_the_decoder(gs: GatewayStack, http: httpx.Client) -> None:
    """An earlier assistant turn's tool-call arguments too deep for Python's JSON decoder: the
    template gets them as the text they are (no 500), and the next request still runs."""
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls}]
    r = http.post(
        f"{gs.url}/v1/chat/completions", headers=gs.headers, json=chat(messages, max_tokens=2)
    )
    assert r.status_code == 200, r.text
    ok = http.post(f"{gs.url}/v1/completions", headers=gs.headers, json=completion(max_tokens=2))
    assert ok.status_code == 200, ok.text
