"""vLLM parity details of the HTTP API, against real processes (a worker, the control plane,
the gateway): unknown fields, `stop_reason`, stream chunks, `include_stop_str_in_output`,
`echo`, `/v1/models` `created`, the OpenAPI schema's 200s, /tokenize, /detokenize, /version,
HEAD, and `pagedserve stats --json`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from gateway.schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ModelList,
    TokenizeResponse,
)
from protos.v1 import control_plane_pb2 as pb
from tests.gateway_stack import GatewayStack, shared_gateway_stack

PROMPT = "The quick brown fox"
USER = [{"role": "user", "content": "Say something."}]
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}
# Never matches; holds back len - 1 characters, so no step's tokens complete any text.
NEVER = "\x01" * 1000


@pytest.fixture(scope="module")
def gs(pytestconfig: pytest.Config, micro_llama: Path) -> GatewayStack:
    return shared_gateway_stack(pytestconfig, micro_llama)


@pytest.fixture(scope="module")
def client(gs: GatewayStack) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{gs.url}/v1", api_key=gs.api_key, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(gs: GatewayStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gs.url, headers=gs.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(micro_llama: Path) -> Tokenizer:
    return Tokenizer.from_file(str(micro_llama / "tokenizer.json"))


def events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed response, [DONE] checked and left out."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def completion(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"prompt": PROMPT, **GREEDY, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def gateway_log(gs: GatewayStack) -> list[dict[str, Any]]:
    return [json.loads(x) for x in gs.gateway.output().splitlines() if x.startswith("{")]


# -- unknown fields --------------------------------------------------------------------------


def test_unknown_fields_are_ignored_with_one_warning(gs: GatewayStack, http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "frobnicate": 1, "guided_decoding_backend": "x"}
    r = http.post("/v1/completions", json=body, headers={"x-request-id": "unknown-1"})
    assert r.status_code == 200, r.text
    chat = {"messages": [{**USER[0], "mood": "calm"}], "max_tokens": 2, "tool_x": 1}
    r = http.post("/v1/chat/completions", json=chat, headers={"x-request-id": "unknown-2"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 5
    while True:
        lines = [x for x in gateway_log(gs) if x["event"] == "unknown_fields_ignored"]
        found = {x.get("request_id"): x for x in lines}
        if {"unknown-1", "unknown-2"} <= set(found) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert found["unknown-1"]["fields"] == ["frobnicate", "guided_decoding_backend"]
    assert found["unknown-1"]["level"] == "warning"
    assert found["unknown-2"]["fields"] == ["tool_x", "messages.0.mood"]
    assert sum(1 for x in lines if x.get("request_id") == "unknown-1") == 1


# -- stop_reason -----------------------------------------------------------------------------


def test_stop_reason_is_the_stop_token_id(
    gs: GatewayStack, http: httpx.Client, client: OpenAI
) -> None:
    assert completion(http, max_tokens=16)["choices"][0]["stop_reason"] is None  # length
    req = pb.GenerateRequest(text=PROMPT)
    req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = 16, 0.0, True
    ids = [t for msg in gs.stack.stub.Generate(req, timeout=60) for t in msg.token_ids]
    stop_id = ids[5]
    out = completion(http, max_tokens=16, stop_token_ids=[stop_id])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop_id and isinstance(choice["stop_reason"], int)
    assert out["usage"]["completion_tokens"] == ids.index(stop_id) + 1
    body = {"prompt": PROMPT, "max_tokens": 16, "stop_token_ids": [stop_id], **GREEDY}
    streamed = events(http, "/v1/completions", body)
    assert streamed[-1]["choices"][0]["stop_reason"] == stop_id
    # The openai client reads it too.
    parsed = client.completions.create(
        model="", prompt=PROMPT, max_tokens=16, extra_body={**GREEDY, "stop_token_ids": [stop_id]}
    )
    assert parsed.choices[0].model_extra == {"stop_reason": stop_id}
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 16, "stop_token_ids": [stop_id], **GREEDY},
    ).json()
    if chat["choices"][0]["finish_reason"] == "stop":
        assert chat["choices"][0]["stop_reason"] == stop_id


# -- stream chunks ---------------------------------------------------------------------------


def test_no_empty_chunks_while_text_is_held_back(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "stop": [NEVER], **GREEDY}
    chunks = events(http, "/v1/completions", body)
    for c in chunks:
        [choice] = c["choices"]
        assert choice["text"] or choice["finish_reason"], c
    assert len(chunks) == 1 and chunks[0]["choices"][0]["finish_reason"] == "length"
    whole = completion(http, max_tokens=12, stop=[NEVER])
    assert chunks[0]["choices"][0]["text"] == whole["choices"][0]["text"]

    chat_body = {"messages": USER, "max_tokens": 12, "stop": [NEVER], **GREEDY}
    chat = events(http, "/v1/chat/completions", chat_body)
    head, rest = chat[0], chat[1:]
    assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for c in rest:
        [choice] = c["choices"]
        assert choice["delta"].get("content") or choice["finish_reason"], c
    assert len(rest) == 1

    # Logprobs the client asked for still arrive with every step, text or not.
    with_lp = events(http, "/v1/completions", {**body, "logprobs": 0})
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in with_lp) == 12
    assert len(with_lp) > 1


# -- include_stop_str_in_output --------------------------------------------------------------


def test_include_stop_str_in_output(http: httpx.Client, client: OpenAI) -> None:
    full = completion(http, max_tokens=24)["choices"][0]["text"]
    clean = [i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, full
    stop = full[clean[0] : clean[0] + 2]
    end = full.index(stop) + len(stop)
    kept = completion(http, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == full[:end]
    assert kept["choices"][0]["stop_reason"] == stop
    cut = completion(http, max_tokens=24, stop=[stop])
    assert cut["choices"][0]["text"] == full[: end - len(stop)]
    streamed = client.completions.create(
        model="", prompt=PROMPT, max_tokens=24, stop=[stop], stream=True,
        extra_body={**GREEDY, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == full[:end]


# -- echo ------------------------------------------------------------------------------------


def test_echo_puts_the_prompt_first(
    http: httpx.Client, client: OpenAI, tokenizer: Tokenizer
) -> None:
    plain = completion(http, max_tokens=6)["choices"][0]["text"]
    echoed = completion(http, max_tokens=6, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain
    assert echoed["usage"]["completion_tokens"] == 6
    streamed = client.completions.create(
        model="", prompt=PROMPT, max_tokens=6, echo=True, stream=True, extra_body=GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain
    # A token-id prompt is echoed as its text; every choice of a batch gets its own prompt.
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    batch = completion(http, prompt=[ids, [ids[-1]]], n=2, max_tokens=3, echo=True)
    texts = [c["text"] for c in batch["choices"]]
    prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
    assert texts[0].startswith(prompt_text) and texts[1].startswith(prompt_text)
    last = tokenizer.decode([ids[-1]], skip_special_tokens=False)
    assert texts[2].startswith(last) and texts[3].startswith(last)


def test_echo_with_logprobs_starts_with_the_prompt_tokens(
    http: httpx.Client, client: OpenAI, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    plain = completion(http, max_tokens=4, logprobs=2)["choices"][0]["logprobs"]
    body = completion(http, max_tokens=4, logprobs=2, echo=True)
    CompletionResponse.model_validate(body)
    lps = body["choices"][0]["logprobs"]
    prompt_tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lps["tokens"] == prompt_tokens + plain["tokens"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lps["token_logprobs"][1:])
    assert lps["token_logprobs"][len(ids) :] == plain["token_logprobs"]
    assert all(len(t) <= 3 for t in lps["top_logprobs"][1:])  # 2 alternatives + the token
    assert lps["text_offset"] == sorted(lps["text_offset"])
    # Streamed: the first chunk carries the prompt's part, the client parses it.
    streamed = client.completions.create(
        model="", prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, stream=True,
        extra_body=GREEDY,
    )  # fmt: skip
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lps["tokens"]


def test_prompt_logprobs_as_vllm_returns_them(http: httpx.Client, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    body = completion(http, max_tokens=2, prompt_logprobs=2, n=2, seed=3, temperature=1)
    CompletionResponse.model_validate(body)
    for choice in body["choices"]:  # every choice of the prompt carries them
        plps = choice["prompt_logprobs"]
        assert len(plps) == len(ids) and plps[0] is None
        for token_id, entry in zip(ids[1:], plps[1:], strict=True):
            mine = entry[str(token_id)]
            assert mine["logprob"] <= 0 and mine["rank"] >= 1
            assert mine["decoded_token"] == tokenizer.decode([token_id], skip_special_tokens=False)
            ranks = sorted(e["rank"] for k, e in entry.items() if k != str(token_id))
            assert ranks in ([1, 2], [1], [2], [])  # the alternatives, less the token itself
    assert body["choices"][0]["prompt_logprobs"] == body["choices"][1]["prompt_logprobs"]
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2, "prompt_logprobs": 0, **GREEDY},
    ).json()
    ChatCompletionResponse.model_validate(chat)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    r = http.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = http.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 21})
    assert r.status_code == 400


# -- /v1/models, OpenAPI ---------------------------------------------------------------------


def test_models_created_is_a_timestamp(http: httpx.Client, client: OpenAI) -> None:
    [model] = client.models.list().data
    now = time.time()
    assert now - 24 * 3600 < model.created <= now
    again = ModelList.model_validate(http.get("/v1/models").json())
    assert again.data[0].created == model.created


def test_openapi_declares_typed_200s(gs: GatewayStack, http: httpx.Client) -> None:
    schema = httpx.get(f"{gs.url}/openapi.json", headers=gs.headers).json()
    paths = schema["paths"]

    def ok(path: str, method: str = "get") -> dict[str, Any]:
        content: dict[str, Any] = paths[path][method]["responses"]["200"]["content"]
        return content

    expected = {
        ("/v1/completions", "post"): "CompletionResponse",
        ("/v1/chat/completions", "post"): "ChatCompletionResponse",
        ("/v1/models", "get"): "ModelList",
        ("/health", "get"): "HealthStatus",
        ("/tokenize", "post"): "TokenizeResponse",
        ("/detokenize", "post"): "DetokenizeResponse",
        ("/version", "get"): "VersionResponse",
    }
    for (path, method), name in expected.items():
        ref = ok(path, method)["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}", path
    for path, chunk in (("/v1/completions", "Completion"), ("/v1/chat/completions", "Chat")):
        sse = ok(path, "post")["text/event-stream"]["schema"]
        assert f"{chunk}" in sse["description"]
    components = schema["components"]["schemas"]
    assert {"CompletionChunk", "ChatCompletionChunk", "Usage"} <= set(components)
    stop_reason = components["CompletionChoice"]["properties"]["stop_reason"]
    assert {"type": "integer"} in stop_reason["anyOf"]

    # What the routes send matches what the schema says.
    CompletionResponse.model_validate(completion(http, max_tokens=3, logprobs=1))
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
    ChatCompletionResponse.model_validate(chat.json())
    body = {"prompt": PROMPT, "max_tokens": 3, "stream_options": {"include_usage": True}}
    for event in events(http, "/v1/completions", body):
        CompletionChunk.model_validate(event)
    chat_body = {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    for event in events(http, "/v1/chat/completions", chat_body):
        ChatCompletionChunk.model_validate(event)


# -- /tokenize, /detokenize, /version --------------------------------------------------------


def test_tokenize_as_vllm(gs: GatewayStack, http: httpx.Client, tokenizer: Tokenizer) -> None:
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    r = http.post("/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    assert r.json() == {"count": len(ids), "max_model_len": max_len, "tokens": ids,
                        "token_strs": None}  # fmt: skip
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "add_special_tokens": False,
            "return_token_strs": True}  # fmt: skip
    bare = TokenizeResponse.model_validate(http.post("/tokenize", json=body).json())
    assert bare.tokens == tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert bare.token_strs == [tokenizer.id_to_token(t) for t in bare.tokens]
    # Messages count as the chat completion's prompt does.
    chat = http.post("/tokenize", json={"messages": USER}).json()
    usage = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).json()
    assert chat["count"] == usage["usage"]["prompt_tokens"] == len(chat["tokens"])
    no_gen = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": False})
    assert no_gen.json()["count"] < chat["count"]


def test_detokenize_and_version(gs: GatewayStack, http: httpx.Client, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    version = httpx.get(f"{gs.url}/version")  # open, as /health is
    assert version.status_code == 200 and version.json() == {"version": "0.1.0"}


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": "a", "messages": USER}, 400),
        ("/tokenize", {"prompt": ""}, 400),
        ("/tokenize", {"prompt": 5}, 400),
        ("/tokenize", {"messages": USER, "add_special_tokens": True}, 400),
        ("/tokenize", {"messages": USER, "tools": [{"type": "function"}]}, 400),
        ("/tokenize", {"prompt": "a", "model": "gpt-5"}, 404),
        ("/detokenize", {"tokens": [1, 99_999_999]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": "abc"}, 400),
        ("/detokenize", {"tokens": [1], "model": "gpt-5"}, 404),
    ],
)
def test_tokenization_errors(
    http: httpx.Client, path: str, body: dict[str, Any], status: int
) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenization_needs_the_api_key(gs: GatewayStack) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(f"{gs.url}{path}", json=body)
        assert r.status_code == 401, r.text


# -- HEAD ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/version", "/openapi.json"])
@pytest.mark.parametrize("with_key", [True, False])
def test_head_answers_like_get(gs: GatewayStack, path: str, with_key: bool) -> None:
    headers = gs.headers if with_key else {}
    get = httpx.get(f"{gs.url}{path}", headers=headers)
    head = httpx.head(f"{gs.url}{path}", headers=headers)
    assert head.status_code == get.status_code
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.content == b""
    if path != "/metrics":  # its counters move between the two calls
        assert head.headers.get("content-length") == get.headers.get("content-length")
    assert head.headers["x-request-id"]


# -- pagedserve stats --json -----------------------------------------------------------------


def test_stats_json_prints_numbers_and_zeros(gs: GatewayStack) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "stats", "--control-plane", gs.stack.address,
         "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert isinstance(stats["num_requests_finished"], int) and stats["num_requests_finished"] > 0
    assert stats["num_swapped"] == 0  # a zero field is printed too
    [worker] = stats["workers"]
    for key in ("num_steps", "num_generated_tokens", "epoch", "num_preemptions"):
        assert isinstance(worker[key], int), (key, worker[key])
    assert worker["num_swap_preemptions"] == 0 and worker["healthy"] is True
