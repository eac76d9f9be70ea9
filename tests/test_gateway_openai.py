"""The gateway through the official `openai` client, against real processes (redis-server, a
worker, the control plane, the gateway): completions and chat, streamed and not, n = 2,
logprobs, stop strings, usage, request ids, metrics, and a client that drops mid-stream."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.gateway_stack import GatewayStack, shared_gateway_stack

PROMPT = "The quick brown fox"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def gs(pytestconfig: pytest.Config, micro_llama: Path) -> GatewayStack:
    return shared_gateway_stack(pytestconfig, micro_llama)


@pytest.fixture(scope="module")
def client(gs: GatewayStack) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{gs.url}/v1", api_key=gs.api_key, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(micro_llama: Path) -> Tokenizer:
    return Tokenizer.from_file(str(micro_llama / "tokenizer.json"))


def test_models_health_and_usage(
    gs: GatewayStack, client: OpenAI, micro_llama: Path, tokenizer: Tokenizer
) -> None:
    assert [m.id for m in client.models.list().data] == [micro_llama.name]
    assert httpx.get(f"{gs.url}/health").status_code == 200
    out = client.completions.create(
        model=micro_llama.name, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    assert out.object == "text_completion" and out.model == micro_llama.name
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.text
    expected_prompt = len(tokenizer.encode(PROMPT, add_special_tokens=True).ids)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (expected_prompt, 12)
    assert out.usage.total_tokens == expected_prompt + 12
    # The model may be left out: the gateway answers with the served model.
    bare = httpx.post(
        f"{gs.url}/v1/completions",
        headers=gs.headers,
        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **IGNORE_EOS},
    ).json()
    assert bare["model"] == micro_llama.name and bare["choices"][0]["text"] == choice.text


def test_completion_stream_equals_whole_for_same_seed(client: OpenAI) -> None:
    kw = dict(
        model="", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, extra_body=IGNORE_EOS
    )
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    other_seed = client.completions.create(**{**kw, "seed": 8})  # type: ignore[call-overload]
    assert other_seed.choices[0].text != whole.choices[0].text


def test_chat_stream_equals_whole_and_text_parts(client: OpenAI) -> None:
    kw = dict(
        model="",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something."},
        ],
        max_tokens=20,
        temperature=0.8,
        seed=3,
        extra_body=IGNORE_EOS,
    )
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 20
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)  # type: ignore[call-overload]
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage
    # Content as a list of text parts is the same conversation.
    parts = dict(kw)
    parts["messages"] = [
        kw["messages"][0],  # type: ignore[index]
        {"role": "user", "content": [{"type": "text", "text": "Say something."}]},
    ]
    again = client.chat.completions.create(**parts)  # type: ignore[call-overload]
    assert again.choices[0].message.content == whole.choices[0].message.content


def test_n2_choices_usage_and_streamed_choices(client: OpenAI) -> None:
    kw = dict(
        model="", prompt=PROMPT, n=2, max_tokens=10, temperature=1.0, seed=11,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in whole.choices] == [0, 1]
    texts = [c.text for c in whole.choices]
    assert texts[0] != texts[1]
    single = client.completions.create(**{**kw, "n": 1, "max_tokens": 10})  # type: ignore[call-overload]
    assert whole.usage is not None and single.usage is not None
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert whole.usage.completion_tokens == 20
    assert single.choices[0].text == texts[0]  # choice 0 samples with the request's seed
    streamed = ["", ""]
    for chunk in client.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5, seed=1,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]


def test_logprobs(client: OpenAI) -> None:
    out = client.completions.create(
        model="", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, extra_body=IGNORE_EOS
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen >= max(top.values()) - 1e-4  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob >= entry.top_logprobs[0].logprob - 1e-4
    plain = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert plain.choices[0].logprobs is None


def test_stop_string(client: OpenAI) -> None:
    kw = dict(model="", prompt=PROMPT, temperature=0, extra_body=IGNORE_EOS)
    full = client.completions.create(max_tokens=24, **kw).choices[0].text  # type: ignore[call-overload]
    clean = [i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, full
    at = clean[0]
    stop = full[at : at + 2]
    first = full.index(stop)
    out = client.completions.create(max_tokens=24, stop=[stop], **kw).choices[0]  # type: ignore[call-overload]
    assert out.finish_reason == "stop"
    assert out.text == full[:first]
    assert out.model_extra is not None and out.model_extra["stop_reason"] == stop
    streamed = client.completions.create(max_tokens=24, stop=stop, stream=True, **kw)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed) == full[:first]


def test_batch_and_token_id_prompts(client: OpenAI, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    by_ids = client.completions.create(model="", prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model="", prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    kw = dict(model="", max_tokens=4, temperature=0, extra_body=IGNORE_EOS)
    batch = client.completions.create(prompt=[PROMPT, "Hello"], n=2, **kw)  # type: ignore[call-overload]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = client.completions.create(prompt="Hello", **kw).choices[0].text  # type: ignore[call-overload]
    assert batch.choices[2].text == batch.choices[3].text == alone
    assert batch.usage is not None and batch.usage.completion_tokens == 16
    hello = len(tokenizer.encode("Hello", add_special_tokens=True).ids)
    assert batch.usage.prompt_tokens == len(ids) + hello


def test_request_id_echoed_and_logged(gs: GatewayStack) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "n": 2}
    r = httpx.post(
        f"{gs.url}/v1/completions",
        json=body,
        headers={**gs.headers, "x-request-id": "trace-42"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42"

    def logged() -> bool:
        lines = [json.loads(x) for x in gs.gateway.output().splitlines() if x.startswith("{")]
        return any(
            x.get("request_id") == "trace-42" and x["event"] == "http_request" for x in lines
        )

    # The access line is written once the response is out: it may land just after the client
    # has read the body.
    deadline = time.monotonic() + 60
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged()
    cp_log = gs.stack.control_plane.output()
    # n = 2 is one upstream request, forked inside the control plane.
    assert '"request_id": "trace-42"' in cp_log and "trace-42-" not in cp_log
    # A malformed id is replaced, not trusted.
    r = httpx.post(
        f"{gs.url}/v1/completions", json=body, headers={**gs.headers, "x-request-id": "a b"}
    )
    assert r.status_code == 200 and r.headers["x-request-id"] != "a b"


# How long blocks may take to come back: the requests below would hold theirs for 1,500 tokens
# or more, and the aborts counted show that they did not.
FREED_S = 120.0


def test_client_dropping_mid_stream_frees_its_blocks(gs: GatewayStack) -> None:
    assert gs.wait_all_blocks_free(FREED_S)
    aborted = gs.stack.stats().num_requests_aborted
    body = {"prompt": PROMPT, "max_tokens": 1500, "stream": True, "n": 2, **IGNORE_EOS}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gs.url}/v1/completions", json=body, headers=gs.headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6), strict=False) if line]
            assert got and all(line.startswith("data: {") for line in got)
            assert not gs.all_blocks_free()
        # Leaving the block closes the connection mid-stream.
    assert gs.wait_all_blocks_free(FREED_S), "blocks not back after the disconnect"
    assert gs.stack.stats().num_requests_aborted >= aborted + 1  # one request, n = 2


def test_a_request_id_in_use_is_refused_and_the_running_one_goes_on(gs: GatewayStack) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, **IGNORE_EOS}
    headers = {**gs.headers, "x-request-id": "in-use-42"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gs.url}/v1/completions", json=body, headers=headers) as r:
            lines = (line for line in r.iter_lines() if line)
            assert next(lines).startswith("data: {")
            again = http.post(
                f"{gs.url}/v1/completions", json={**body, "stream": False}, headers=headers
            )
            assert again.status_code == 409, again.text
            error = again.json()["error"]
            assert "already in use" in error["message"]
            assert error["code"] == "duplicate_request_id"
            rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    text_events = [json.loads(x[6:]) for x in rest[:-1]]
    assert text_events[-1]["choices"][0]["finish_reason"] == "length"


def test_client_dropping_while_waiting_for_whole_answer(gs: GatewayStack) -> None:
    assert gs.wait_all_blocks_free(FREED_S)
    aborted = gs.stack.stats().num_requests_aborted
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1800, **IGNORE_EOS}).encode()
    host, port = gs.url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: {gs.headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head.encode() + body)
        deadline = time.monotonic() + FREED_S
        while gs.all_blocks_free():  # until it runs
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
    # Gone before its answer: aborted, not computed to its end.
    assert gs.wait_all_blocks_free(FREED_S), "blocks not back after the disconnect"
    assert gs.stack.stats().num_requests_aborted >= aborted + 1


def test_metrics(gs: GatewayStack, client: OpenAI) -> None:
    client.completions.create(model="", prompt=PROMPT, max_tokens=4, extra_body=IGNORE_EOS)
    # Inter-token latencies come from streams only (a whole answer is one message).
    stream = client.completions.create(
        model="", prompt=PROMPT, max_tokens=4, stream=True, extra_body=IGNORE_EOS
    )
    assert sum(len(c.choices[0].text) > 0 for c in stream) > 1
    text = httpx.get(f"{gs.url}/metrics").text
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.get("le")
    }
    for name in (
        "pagedserve:num_requests_running",
        "pagedserve:num_requests_waiting",
        "pagedserve:num_requests_swapped",
        "pagedserve:gpu_cache_usage_perc",
        "pagedserve:num_preemptions_total",
        "pagedserve:gpu_prefix_cache_queries_total",
        "pagedserve:gpu_prefix_cache_hits_total",
    ):
        assert name in samples, name
    assert samples["pagedserve:time_to_first_token_seconds_count"] >= 1
    assert samples["pagedserve:inter_token_latency_seconds_count"] >= 1
    assert samples["pagedserve:e2e_request_latency_seconds_count"] >= 1
    assert samples["pagedserve:generation_tokens_total"] >= 4
    assert samples["pagedserve:prompt_tokens_total"] >= 1
    assert samples["pagedserve:num_healthy_workers"] == 1
    assert 'pagedserve:request_success_total{finished_reason="length"' in text


def test_grpc_cli_and_http_share_defaults(gs: GatewayStack, tokenizer: Tokenizer) -> None:
    """The same text prompt gives the same tokens over HTTP, a raw gRPC client that sets
    nothing, and `pagedserve generate --prompt`: BOS added on every surface unless asked
    not to; chat turns get the generation prompt by default."""
    import subprocess
    import sys

    from protos.v1 import control_plane_pb2 as pb

    def grpc_ids(req: pb.GenerateRequest) -> tuple[list[int], int]:
        req.sampling.max_tokens = 8
        req.sampling.temperature = 0.0
        req.sampling.ignore_eos = True
        chunks = list(gs.stack.stub.Generate(req, timeout=60))
        return [t for c in chunks for t in c.token_ids], chunks[-1].prompt_tokens

    raw, raw_prompt = grpc_ids(pb.GenerateRequest(text=PROMPT))
    assert raw_prompt == len(tokenizer.encode(PROMPT, add_special_tokens=True).ids)
    _, bare_prompt = grpc_ids(pb.GenerateRequest(text=PROMPT, add_special_tokens=False))
    assert bare_prompt == raw_prompt - 1

    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **IGNORE_EOS}
    http = httpx.post(f"{gs.url}/v1/completions", headers=gs.headers, json=body).json()
    http_ids = tokenizer.encode(http["choices"][0]["text"], add_special_tokens=False).ids
    assert http["usage"]["prompt_tokens"] == raw_prompt
    assert tokenizer.decode(raw) == http["choices"][0]["text"]

    def cli(*flags: str) -> str:
        argv = [sys.executable, "-m", "pagedserve.cli", "generate", "--control-plane"]
        argv += [gs.stack.address, "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos"]
        out = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert cli().startswith(http["choices"][0]["text"])
    assert f"prompt_tokens={raw_prompt} " in cli()
    assert f"prompt_tokens={raw_prompt - 1} " in cli("--no-special-tokens")
    assert http_ids  # the text decodes back to tokens

    chat = pb.GenerateRequest()
    chat.chat.messages.add(role="user", content="hi")
    _, with_prompt = grpc_ids(chat)
    chat.chat.add_generation_prompt = False
    _, without = grpc_ids(chat)
    assert with_prompt > without  # "<|assistant|>\n" is added unless turned off
