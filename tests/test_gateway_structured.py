"""Structured output and tool calling on the HTTP API: `response_format`, vLLM's `guided_*`
and `structured_outputs`, `logit_bias`, `tools` with every `tool_choice`.

Without a model: the tool-call parsers (streamed in any pieces, they give what the whole text
gives), the `"required"` schema (the grammar library takes it; its instances are the calls), the
client-schema checks. On the micro random model: every 400, the gateway's and the control
plane's, naming the field; constrained choices, streamed and not, n > 1; `"auto"` through a
chat template that renders tools. On SmolLM2 with the official `openai` client: a JSON schema,
forced tool calls, `guided_choice` and `logit_bias` as a client sees them.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import jsonschema
import pytest
from openai import OpenAI

from gateway.chat_completion.protocol import ChatCompletionRequest
from gateway.completion.protocol import CompletionRequest
from gateway.errors import APIError
from gateway.json_schema import SchemaError, check_schema
from gateway.responses import ChatFormat
from gateway.sampling import sampling_proto
from gateway.schemas import ChatCompletionChunk, ChatCompletionResponse
from gateway.tool_parsers import (
    CallListParser,
    HermesParser,
    NamedCallParser,
    Parsed,
    ToolCallParser,
    member_text,
    merge_calls,
)
from gateway.tools import required_schema
from pagedserve import grammar
from pagedserve.cli.model_source import ensure_default_model
from pagedserve.sampling_params import StructuredOutput
from pagedserve.wire import sampling_from_proto
from tests.gateway_stack import GatewayStack, HttpProcess, Processes, shared_gateway_stack
from tests.procs import ServerProcess
from tests.stack import generate, start_stack

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
UNIT_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["unit"],
    "additionalProperties": False,
}


def tool(name: str, parameters: Any = None, **fn: Any) -> dict[str, Any]:
    function = {"name": name, **fn}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", WEATHER_PARAMS, description="The weather in a city")
TIME = tool("get_time", TIME_PARAMS, description="The time in a timezone")
UNIT = tool("pick_unit", UNIT_PARAMS)
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS, "pick_unit": UNIT_PARAMS}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# -- without a model: parsers, schemas, request checks ----------------------------------------


def run_parser(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    parts = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(p.content for p in parts)
    return content, merge_calls([c for p in parts for c in p.calls])


def in_pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def functions(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


CALL_A = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
CET = ("get_time", {"timezone": "CET"})

HERMES = [
    # text, content, calls
    (CALL_A, "", [PARIS]),
    (f"Let me look.\n{CALL_A}\n{CALL_B}\n", "Let me look.", [PARIS, CET]),
    (f"{CALL_A}\n\nIt is sunny.", "It is sunny.", [PARIS]),
    (f"Before {CALL_B} after", "Before after", [CET]),
    ("No call at all.  \n", "No call at all.  \n", []),
    ("a <tool_c", "a <tool_c", []),
    ("x < y and <tool", "x < y and <tool", []),
    # Not a call of one of the tools: the block stays text, whitespace and all.
    (
        'Hm <tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        'Hm <tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        [],
    ),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    # Unclosed at the end (max_tokens, or a model that leaves the tag out).
    ('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}', "", [CET]),
    ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
    # Arguments as a string of JSON, or under "parameters".
    (
        '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"CET\\"}"}</tool_call>',
        "",
        [CET],
    ),
    ('<tool_call>{"name": "get_time", "parameters": {"timezone": "CET"}}</tool_call>', "", [CET]),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_parser(text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    names = {"get_weather", "get_time"}
    whole = run_parser(HermesParser(names), [text])
    assert whole[0] == content
    assert functions(whole[1]) == calls
    for size in (1, 2, 3, 5, 11):
        got = run_parser(HermesParser(names), in_pieces(text, size))
        assert (got[0], functions(got[1])) == (content, calls), size


def test_hermes_stream_holds_back_only_a_possible_tag() -> None:
    p = HermesParser({"get_time"})
    assert p.feed("Hello").content == "Hello"
    assert p.feed(" there <tool").content == " there"  # the space may sit before a call
    assert p.feed("kit>").content == " <toolkit>"
    assert p.feed(" done").content == " done"
    assert p.finish() == Parsed()


def test_call_list_parser() -> None:
    names = {"get_weather", "get_time"}
    text = (
        '[{"name":"get_weather","parameters":{"city":"Pa}ris","unit":"celsius"}},'
        '{"name":"get_time","parameters":{"timezone":"CET"}}]'
    )
    for size in (1, 4, 9, len(text)):
        parser = CallListParser(names)
        deltas = [parser.feed(p) for p in in_pieces(text, size)]
        # Each call goes out whole, as soon as its object closes.
        assert sum(len(d.calls) for d in deltas) == 2
        assert parser.finish() == Parsed()
    content, calls = run_parser(CallListParser(names), [text])
    assert content == ""
    assert functions(calls) == [("get_weather", {"city": "Pa}ris", "unit": "celsius"}), CET]
    assert [c["id"] for c in calls][0] != [c["id"] for c in calls][1]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    # Cut before the first call closed: the text is given as content.
    assert run_parser(CallListParser(names), ['[{"name":"get_ti']) == ('[{"name":"get_ti', [])
    # Cut after one: the complete call, the rest dropped.
    content, calls = run_parser(CallListParser(names), [text[:80]])
    assert content == "" and len(calls) == 1


def test_arguments_keep_the_text_the_model_wrote() -> None:
    text = '[{"name": "get_time", "parameters": {"timezone": "CET"}}]'
    [call] = run_parser(CallListParser({"get_time"}), [text])[1]
    assert call["function"]["arguments"] == '{"timezone": "CET"}'
    [call] = run_parser(HermesParser({"get_weather"}), [CALL_A])[1]
    assert call["function"]["arguments"] == '{"city": "Paris", "unit": "celsius"}'
    assert member_text('{"a" : [1, {"b": 2}] , "b":{ }}', 0, "b") == "{ }"
    assert member_text('{"a": 1}', 0, "b") is None
    assert member_text('{"a": 1', 0, "a") == "1"
    assert member_text("[1]", 0, "a") is None


def test_named_parser_streams_argument_pieces() -> None:
    parser = NamedCallParser("get_time")
    first = parser.feed('{"timezone"')
    assert first.calls[0]["function"] == {"name": "get_time", "arguments": '{"timezone"'}
    assert first.calls[0]["type"] == "function" and first.calls[0]["id"].startswith("call_")
    assert parser.feed(':"CET"}').calls == [{"index": 0, "function": {"arguments": ':"CET"}'}}]
    assert parser.finish() == Parsed()
    content, calls = run_parser(NamedCallParser("get_time"), ['{"timezone"', ':"CET"}'])
    assert functions(calls) == [CET] and content == ""
    # Nothing generated: one call, empty arguments.
    assert run_parser(NamedCallParser("f"), [])[1][0]["function"] == {"name": "f", "arguments": ""}


def test_required_schema_takes_exactly_the_calls() -> None:
    defs_params: dict[str, Any] = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/place"}},
        "required": ["where"],
        "$defs": {"place": {"type": "string", "enum": ["home", "work"]}},
    }
    tools = [("get_weather", WEATHER_PARAMS), ("go", defs_params)]
    schema = required_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
        {"name": "go", "parameters": {"where": "home"}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "go", "parameters": {"where": "moon"}}],  # the moved $ref still applies
        [{"name": "get_weather", "parameters": {"where": "home"}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "go"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(tools, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    jsonschema.validate(good[:1], single)
    # The engine's grammar library takes it.
    grammar.check(StructuredOutput("json_schema", json.dumps(schema)))


@pytest.mark.parametrize(
    "schema,where",
    [
        ([], "p"),
        ({"type": "wat"}, "p.type"),
        ({"type": ["string", "string"]}, "p.type"),
        ({"properties": []}, "p.properties"),
        ({"properties": {"a": {"type": "strin"}}}, "p.properties.a.type"),
        ({"properties": {"a": 5}}, "p.properties.a"),
        ({"items": {"minItems": -1}}, "p.items.minItems"),
        ({"anyOf": []}, "p.anyOf"),
        ({"required": "a"}, "p.required"),
        ({"enum": []}, "p.enum"),
        ({"minLength": 5, "maxLength": 2}, "p.minLength"),
        ({"multipleOf": 0}, "p.multipleOf"),
        ({"pattern": 5}, "p.pattern"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "p.properties.a.$ref"),
    ],
)
def test_check_schema_names_where(schema: Any, where: str) -> None:
    with pytest.raises(SchemaError) as info:
        check_schema(schema, "p")
    assert info.value.path == where


def test_check_schema_passes_valid_schemas() -> None:
    for schema in (
        {},
        WEATHER_PARAMS,
        {"type": ["string", "null"], "unknownKeyword": {"x": 1}},
        {"items": [{"type": "integer"}, True], "additionalItems": False},
        {
            "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
            "$ref": "#/$defs/n",
        },  # fmt: skip
        {"properties": {"$ref": {"type": "string"}}},  # a property called $ref
    ):
        check_schema(schema, "p")


def _sampling(model: type[CompletionRequest | ChatCompletionRequest], body: dict[str, Any]) -> Any:
    req = model.model_validate(body)
    req.check()
    return req, sampling_proto(req, None)


def test_what_reaches_the_control_plane() -> None:
    cases: list[tuple[Any, dict[str, Any], str, Any]] = [
        (
            CompletionRequest,
            {"guided_json": {"type": "integer"}},
            "json_schema",
            '{"type":"integer"}',
        ),
        (
            CompletionRequest,
            {"guided_json": '{"type": "integer"}'},
            "json_schema",
            '{"type":"integer"}',
        ),
        (CompletionRequest, {"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        (CompletionRequest, {"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
        (CompletionRequest, {"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        (CompletionRequest, {"response_format": {"type": "json_object"}}, "json_object", True),
        (CompletionRequest, {"structured_outputs": {"regex": "a|b"}}, "regex", "a|b"),
        (CompletionRequest, {"structured_outputs": {"json_object": True}}, "json_object", True),
        (
            ChatCompletionRequest,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER_PARAMS},
                }
            },
            "json_schema",
            WEATHER_PARAMS,
        ),
        (
            ChatCompletionRequest,
            {"tools": [WEATHER, TIME], "tool_choice": named("get_time")},
            "json_schema",
            TIME_PARAMS,
        ),
    ]
    for model, extra, kind, spec in cases:
        body = {"prompt": "x"} if model is CompletionRequest else {"messages": USER}
        req, s = _sampling(model, {**body, **extra})
        so = s.structured_output
        assert so.WhichOneof("constraint") == kind, extra
        value = getattr(so, kind)
        if kind == "choice":
            value = list(value.choices)
        elif kind == "json_schema" and not isinstance(spec, str):
            value = json.loads(value)
        assert value == spec, extra
        params = sampling_from_proto(s, default_max_tokens=16)  # the engine's own checks pass
        assert params.structured is not None
    # Plain text and "none" constrain nothing; "auto" sends the tools for the template.
    for extra in (
        {"response_format": {"type": "text"}},
        {"tools": [WEATHER], "tool_choice": "none"},
        {"tools": [WEATHER]},
        {"tools": [WEATHER], "tool_choice": "auto"},
    ):
        req, s = _sampling(ChatCompletionRequest, {"messages": USER, **extra})
        assert not s.HasField("structured_output"), extra
        rendered = json.loads(req.tools_json()) if req.tools_json() else None
        if req.tool_mode == "auto":
            assert rendered == [WEATHER]
        else:
            assert rendered is None
    bare = tool("ping")  # no parameters: a function without arguments
    req, _ = _sampling(ChatCompletionRequest, {"messages": USER, "tools": [bare]})
    assert json.loads(req.tools_json())[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    req, s = _sampling(CompletionRequest, {"prompt": "x", "logit_bias": {"7": -100, "3": 2.5}})
    assert [(b.token_id, b.bias) for b in s.logit_bias] == [(3, 2.5), (7, -100.0)]
    assert sampling_from_proto(s, default_max_tokens=16).logit_bias == ((3, 2.5), (7, -100.0))


def _event(text: str, finish: str = "", index: int = 0) -> Any:
    from gateway.choices import ChoiceEvent
    from protos.v1 import control_plane_pb2 as pb

    return ChoiceEvent(index, pb.GenerateResponse(text=text, finish_reason=finish))


def test_chat_format_stream_adds_up_to_the_whole_body() -> None:
    from gateway.responses import ChoiceState

    names = {"get_weather", "get_time"}
    text = f"Checking.\n{CALL_A}\n{CALL_B}"
    pieces = in_pieces(text, 7)
    fmt = ChatFormat("id", "m", None, tool_parser=lambda: HermesParser(names))
    chunks = [
        fmt.chunk(_event(p, "stop" if i == len(pieces) - 1 else "")) for i, p in enumerate(pieces)
    ]
    sent = [c for c in chunks if c is not None]
    for c in sent:
        ChatCompletionChunk.model_validate(c)
    deltas = [c["choices"][0]["delta"] for c in sent]
    content = "".join(d.get("content", "") for d in deltas)
    calls = merge_calls([tc for d in deltas for tc in d.get("tool_calls", [])])
    assert sent[-1]["choices"][0]["finish_reason"] == "tool_calls"
    state = ChoiceState(text=[text], finish_reason="stop")
    body = fmt.body({0: state}, {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    ChatCompletionResponse.model_validate(body)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == content == "Checking."
    assert functions(choice["message"]["tool_calls"]) == functions(calls) == [PARIS, CET]
    # Cut by max_tokens: the finish stays "length".
    fmt = ChatFormat("id", "m", None, tool_parser=lambda: NamedCallParser("get_time"))
    last = fmt.chunk(_event('{"timez', "length"))
    assert last is not None and last["choices"][0]["finish_reason"] == "length"


# -- the micro random model: 400s, constrained choices ----------------------------------------


class Case(NamedTuple):
    name: str
    body: dict[str, Any]
    param: str
    path: str = CHAT
    says: str = ""


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 4, **kw}


def completion(**kw: Any) -> dict[str, Any]:
    return {"prompt": "The weather", "max_tokens": 4, **kw}


def json_schema_format(schema: Any, **kw: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **kw}}


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "wat"}}}

REFUSED = [
    Case(
        "two constraints",
        chat(response_format={"type": "json_object"}, guided_json={}),
        "guided_json",
        says="response_format and guided_json",
    ),
    Case(
        "regex and choice",
        completion(guided_regex="a+", guided_choice=["a"]),
        "guided_choice",
        CMPL,
        "guided_regex and guided_choice",
    ),
    Case(
        "structured_outputs twice",
        completion(structured_outputs={"json": {}, "regex": "a"}),
        "structured_outputs.regex",
        CMPL,
    ),
    Case(
        "structured_outputs and guided",
        completion(guided_grammar='root ::= "a"', structured_outputs={"choice": ["a"]}),
        "structured_outputs.choice",
        CMPL,
    ),
    Case(
        "tool_choice and response_format",
        chat(tools=[WEATHER], tool_choice="required", response_format=json_schema_format({})),
        "tool_choice",
        says="response_format.json_schema.schema and tool_choice",
    ),
    Case("response_format type", chat(response_format={"type": "xml"}), "response_format.type"),
    Case(
        "response_format not an object", completion(response_format="json"), "response_format", CMPL
    ),
    Case(
        "json_schema missing",
        chat(response_format={"type": "json_schema"}),
        "response_format.json_schema",
    ),
    Case(
        "json_schema without schema",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format.json_schema.schema",
    ),
    Case(
        "json_schema without name",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        "response_format.json_schema.name",
    ),
    Case(
        "json_schema invalid",
        chat(response_format=json_schema_format(BAD_SCHEMA)),
        "response_format.json_schema.schema",
        says="properties.a.type",
    ),
    Case(
        "json_schema not an object",
        completion(response_format=json_schema_format([1])),
        "response_format.json_schema.schema",
        CMPL,
    ),
    Case(
        "guided_json not JSON",
        completion(guided_json="{nope"),
        "guided_json",
        CMPL,
        "not valid JSON",
    ),
    Case("guided_json a number", completion(guided_json=5), "guided_json", CMPL, "JSON schema"),
    Case(
        "guided_json text of a list",
        completion(guided_json="[1]"),
        "guided_json",
        CMPL,
        "JSON object",
    ),
    Case(
        "guided_json invalid",
        chat(guided_json={"required": "city"}),
        "guided_json",
        says="guided_json.required",
    ),
    Case(
        "structured_outputs.json invalid",
        completion(structured_outputs={"json": {"type": 3}}),
        "structured_outputs.json",
        CMPL,
    ),
    Case("guided_choice empty", completion(guided_choice=[]), "guided_choice", CMPL),
    Case(
        "guided_choice empty string", completion(guided_choice=["a", ""]), "guided_choice.1", CMPL
    ),
    Case("guided_choice not strings", completion(guided_choice=[1, 2]), "guided_choice.0", CMPL),
    Case("guided_regex empty", completion(guided_regex=""), "guided_regex", CMPL),
    Case("logit_bias key", completion(logit_bias={"hello": 1}), "logit_bias", CMPL, "token ids"),
    Case("logit_bias negative key", chat(logit_bias={"-5": 1}), "logit_bias", says="token ids"),
    Case("logit_bias range", completion(logit_bias={"5": 150}), "logit_bias", CMPL, "[-100, 100]"),
    Case("logit_bias value type", chat(logit_bias={"5": "high"}), "logit_bias"),
    Case("logit_bias boolean", chat(logit_bias={"5": True}), "logit_bias"),
    Case("logit_bias a list", completion(logit_bias=[5, 1]), "logit_bias", CMPL),
    Case(
        "logit_bias too many",
        completion(logit_bias={str(i): 1 for i in range(1025)}),
        "logit_bias",
        CMPL,
        "1024",
    ),
    Case(
        "tool without a name",
        chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
        "tools.0.function.name",
    ),
    Case(
        "tool with a bad name", chat(tools=[WEATHER, tool("get weather!")]), "tools.1.function.name"
    ),
    Case("tool with a long name", chat(tools=[tool("f" * 65)]), "tools.0.function.name"),
    Case(
        "tool of another type",
        chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
        "tools.0.type",
    ),
    Case("tool without function", chat(tools=[{"type": "function"}]), "tools.0.function"),
    Case("parameters not an object", chat(tools=[tool("f", [])]), "tools.0.function.parameters"),
    Case(
        "parameters invalid",
        chat(tools=[tool("f", BAD_SCHEMA)]),
        "tools.0.function.parameters",
        says="parameters.properties.a.type",
    ),
    Case(
        "duplicate tool names",
        chat(tools=[WEATHER, TIME, WEATHER]),
        "tools.2.function.name",
        says="unique",
    ),
    Case(
        "tool_choice unknown function",
        chat(tools=[WEATHER], tool_choice=named("get_time")),
        "tool_choice.function.name",
    ),
    Case("tool_choice without tools", chat(tool_choice="required"), "tool_choice"),
    Case("tool_choice none without tools", chat(tool_choice="none"), "tool_choice"),
    Case(
        "tool_choice bad value",
        chat(tools=[WEATHER], tool_choice="always"),
        "tool_choice",
        says='"required"',
    ),
    Case(
        "tool_choice bad object",
        chat(tools=[WEATHER], tool_choice={"type": "function"}),
        "tool_choice",
    ),
]

# Refused by the control plane (the gateway cannot tell), mapped to 400 naming the field.
UPSTREAM_REFUSED = [
    Case(
        "logit_bias past the vocabulary",
        completion(logit_bias={"99999": 5}),
        "logit_bias",
        CMPL,
        "vocab",
    ),
    Case(
        "regex that does not compile",
        completion(guided_regex="([a-"),
        "guided_regex",
        CMPL,
        "regex",
    ),
    Case(
        "structured_outputs regex",
        chat(structured_outputs={"regex": "a{3"}),
        "structured_outputs.regex",
        says="regex",
    ),
    Case(
        "grammar that does not compile",
        chat(guided_grammar="root ::= ("),
        "guided_grammar",
        says="grammar",
    ),
    Case(
        "schema pattern that does not compile",
        chat(response_format=json_schema_format({"type": "string", "pattern": "[a-"})),
        "response_format.json_schema.schema",
        says="json_schema",
    ),
    Case("tools the template does not render", chat(tools=[WEATHER]), "tools", says="render tools"),
]


# /tokenize renders tools as chat's "auto" does.
TOKENIZE_REFUSED = [
    Case(
        "tokenize: tools not rendered", {"messages": USER, "tools": [WEATHER]}, "tools", "/tokenize"
    ),
    Case(
        "tokenize: invalid tools",
        {"messages": USER, "tools": [WEATHER, WEATHER]},
        "tools.1.function.name",
        "/tokenize",
    ),
]


@pytest.fixture(scope="module")
def gs(pytestconfig: pytest.Config, micro_llama: Path) -> GatewayStack:
    return shared_gateway_stack(pytestconfig, micro_llama)


@pytest.fixture(scope="module")
def http(gs: GatewayStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gs.url, headers=gs.headers, timeout=120) as c:
        yield c


@pytest.mark.parametrize(
    "case", REFUSED + UPSTREAM_REFUSED + TOKENIZE_REFUSED, ids=lambda c: c.name
)
def test_refused_with_the_field_named(http: httpx.Client, case: Case) -> None:
    r = http.post(case.path, json=case.body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == case.param, error
    assert case.says in error["message"], error


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_refused_before_the_control_plane(case: Case) -> None:
    model = ChatCompletionRequest if case.path == CHAT else CompletionRequest
    with pytest.raises((APIError, ValueError)):  # pydantic's ValidationError is a ValueError
        _sampling(model, case.body)


def test_engine_refuses_what_the_gateway_lets_through_to_it() -> None:
    """The upstream cases pass the gateway's checks; a constraint, logit_bias and forced tool
    calls with beam search pass both."""
    for case in UPSTREAM_REFUSED:
        _sampling(ChatCompletionRequest if case.path == CHAT else CompletionRequest, case.body)
    for body in (
        completion(guided_choice=["a"], use_beam_search=True),
        chat(logit_bias={"5": 1}, use_beam_search=True),
        chat(use_beam_search=True, tools=[WEATHER], tool_choice="required"),
    ):
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        _, s = _sampling(model, body)
        s.beam_width = 2
        sampling_from_proto(s, default_max_tokens=16)


def test_openapi_documents_the_fields(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    shared = ("logit_bias", "response_format", "guided_json", "guided_regex", "guided_choice")
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        assert set(shared) | {"guided_grammar", "structured_outputs"} <= set(props)
    chat_props = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat_props)
    assert '"required"' in chat_props["tool_choice"]["description"]
    assert {"json", "regex", "choice", "grammar", "json_object"} <= set(
        schemas["StructuredOutputs"]["properties"]
    )
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == [
        "text",
        "json_object",
        "json_schema",
    ]
    assert "schema" in schemas["JsonSchemaFormat"]["properties"]
    assert "pattern" in schemas["FunctionDefinition"]["properties"]["name"]
    message = schemas["AssistantMessage"]["properties"]
    assert {"type": "null"} in message["content"]["anyOf"] and "tool_calls" in message
    assert set(schemas["ToolCall"]["properties"]) == {"id", "type", "function"}
    assert "tool_calls" in schemas["ChatDelta"]["properties"]
    assert set(schemas["ToolCallDelta"]["properties"]) == {"index", "id", "type", "function"}
    assert "tool_calls" in schemas["ChatChoice"]["properties"]["finish_reason"]["description"]


def chat_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    for e in events:
        ChatCompletionChunk.model_validate(e)
    return events


def streamed_choices(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index: its content, its merged tool calls, its finish_reason."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        for c in e["choices"]:
            s = out.setdefault(c["index"], {"content": "", "deltas": [], "finish_reason": None})
            s["content"] += c["delta"].get("content") or ""
            s["deltas"] += c["delta"].get("tool_calls") or []
            s["finish_reason"] = c["finish_reason"] or s["finish_reason"]
    for s in out.values():
        s["tool_calls"] = merge_calls(s.pop("deltas"))
    return out


def check_calls(calls: list[dict[str, Any]], names: set[str] | None = None) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in (names or PARAMS)
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_n2_streamed_and_whole(http: httpx.Client, choice: str) -> None:
    tool_choice = named("pick_unit") if choice == "named" else "required"
    body = chat(
        tools=[UNIT, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=160,
    )
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    ChatCompletionResponse.model_validate(whole)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    for c in whole["choices"]:
        assert c["finish_reason"] == "tool_calls", c
        assert c["message"]["content"] is None
        [call] = c["message"]["tool_calls"]
        check_calls([call], {"pick_unit"} if choice == "named" else {"pick_unit", "get_time"})
    streamed = streamed_choices(chat_events(http, body))
    for c in whole["choices"]:
        s = streamed[c["index"]]
        assert s["finish_reason"] == "tool_calls" and s["content"] == ""
        assert functions(s["tool_calls"]) == functions(c["message"]["tool_calls"])


def test_constrained_completions(http: httpx.Client) -> None:
    colours = ["red", "green", "blue"]
    r = http.post(
        CMPL, json=completion(guided_choice=colours, n=3, temperature=1.0, seed=3, max_tokens=16)
    )
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["text"] in colours and c["finish_reason"] == "stop"
    r = http.post(CMPL, json=completion(guided_regex=r"[0-9]{3}-[a-c]{2}", max_tokens=12))
    [c] = r.json()["choices"]
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", c["text"]) and c["finish_reason"] == "stop"
    grammar = 'root ::= "yes" | "no" | "maybe"'
    r = http.post(
        CMPL,
        json=completion(structured_outputs={"grammar": grammar}, temperature=1.0, max_tokens=16),
    )
    assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe")


def test_a_grammar_past_the_parsers_limits_fails_its_request_only(http: httpx.Client) -> None:
    """2,500 choices sharing their first character: once it is taken, the parser's row holds
    more items than it allows, and the grammar library stops (its masks then allow only EOS).
    The request fails with a 400 naming why, rather than ending with a text outside its
    choices as a "stop" (streamed, with an error, never a stop); a request beside it is
    unharmed."""
    choices = [f"c{i}" for i in range(2500)]
    body = completion(guided_choice=choices, temperature=0, max_tokens=8)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(http.post, CMPL, json=body)
        good = pool.submit(http.post, CMPL, json=completion(max_tokens=8, temperature=0))
        r, ok = bad.result(), good.result()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "structured output failed" in error["message"] and "items" in error["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    with http.stream("POST", CMPL, json={**body, "stream": True}) as s:
        lines = list(s.iter_lines())
    # Before its first event (the first token's text still held back) the status says it.
    assert s.status_code in (200, 400), lines
    assert any("structured output failed" in line for line in lines), lines
    assert not any('"finish_reason":"stop"' in line.replace(" ", "") for line in lines), lines
    # Beam search over the same choices: its beams' candidates were EOS alone.
    beams = {**body, "use_beam_search": True, "n": 2}
    r = http.post(CMPL, json=beams)
    assert r.status_code == 400, r.text
    assert "structured output failed" in r.json()["error"]["message"]


def test_constrained_chat_streams_as_content(http: httpx.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
        "required": ["unit", "ok"],
        "additionalProperties": False,
    }
    body = chat(response_format=json_schema_format(schema), max_tokens=40, temperature=0)
    whole = http.post(CHAT, json=body).json()
    [c] = whole["choices"]
    assert c["finish_reason"] == "stop" and "tool_calls" not in c["message"]
    jsonschema.validate(json.loads(c["message"]["content"]), schema)
    events = chat_events(http, body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed_choices(events)[0]["content"] == c["message"]["content"]


def test_logit_bias_moves_the_greedy_token(gs: GatewayStack, http: httpx.Client) -> None:
    greedy = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}
    # A prompt whose greedy token shows as text of its own (not part of a UTF-8 character).
    for prompt in ([1, 300, 301], [1, 310, 320], [1, 330], [1, 340, 350], [1, 360]):
        first = generate(gs.stack.stub, prompt, **greedy)
        if first.text.isascii() and first.text.isprintable() and first.text:
            break
    else:
        pytest.skip("no candidate prompt's greedy token is printable text")
    [token] = first.token_ids
    body = {"prompt": prompt, **greedy}
    assert http.post(CMPL, json=body).json()["choices"][0]["text"] == first.text
    banned = http.post(CMPL, json={**body, "logit_bias": {str(token): -100}}).json()
    assert banned["choices"][0]["text"] != first.text
    [q] = http.post("/tokenize", json={"prompt": "Q", "add_special_tokens": False}).json()["tokens"]
    forced = http.post(CMPL, json={**body, "logit_bias": {str(q): 100}}).json()
    assert forced["choices"][0]["text"] == "Q"


# -- tool_choice "auto" through a template that renders tools ----------------------------------

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools:{% for t in tools %} "
    "{{ t.function.name }}{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for c in message.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if message.tool_call_id %}[answers {{ message.tool_call_id }}]{% endif %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_gateway(
    micro_llama: Path,
    tmp_path_factory: pytest.TempPathFactory,
    module_spawn: Callable[..., ServerProcess],
) -> Iterator[HttpProcess]:
    model = tmp_path_factory.mktemp("tools") / "micro-tools"
    shutil.copytree(micro_llama, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOLS_TEMPLATE})
    )
    stack = start_stack(module_spawn, model, num_gpu_blocks=64)
    procs = Processes()
    try:
        yield procs.gateway(stack.address)
    finally:
        procs.stop_all()


def test_auto_tool_calls_parsed_from_the_text(tools_gateway: HttpProcess) -> None:
    with httpx.Client(base_url=tools_gateway.url, timeout=120) as http:
        plain = http.post("/tokenize", json={"messages": USER}).json()["count"]
        with_tools = http.post("/tokenize", json={"messages": USER, "tools": [WEATHER, TIME]})
        assert with_tools.status_code == 200, with_tools.text
        shown = with_tools.json()
        # The template wrote the tools' names before the messages.
        text = http.post("/detokenize", json={"tokens": shown["tokens"]}).json()["prompt"]
        assert "Tools: get_weather get_time" in text and shown["count"] > plain
        # The model writes what the regex lets it: text, a call, text.
        call = json.dumps({"name": "get_time", "arguments": {"timezone": "CET"}})
        written = f"One moment.\n<tool_call>\n{call}\n</tool_call>\nDone."
        body = chat(tools=[WEATHER, TIME], guided_regex=re.escape(written), max_tokens=200)
        r = http.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        [c] = r.json()["choices"]
        assert c["finish_reason"] == "tool_calls"
        assert c["message"]["content"] == "One moment.\nDone."
        check_calls(c["message"]["tool_calls"])
        assert functions(c["message"]["tool_calls"]) == [CET]
        s = streamed_choices(chat_events(http, body))[0]
        assert s["content"] == c["message"]["content"] and s["finish_reason"] == "tool_calls"
        assert functions(s["tool_calls"]) == [CET]
        # "none": no tools rendered, nothing parsed.
        none = http.post(CHAT, json={**body, "tool_choice": "none"}).json()["choices"][0]
        assert none["message"]["content"] == written and none["finish_reason"] == "stop"
        assert "tool_calls" not in none["message"]


def test_a_conversation_carries_its_tool_calls_back(tools_gateway: HttpProcess) -> None:
    """The next turn after a tool call: the assistant's tool_calls and the tool message's
    tool_call_id reach the chat template, each call's arguments as the object they hold."""
    arguments = json.dumps({"timezone": "CET"})
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "12:00"},
    ]
    with httpx.Client(base_url=tools_gateway.url, timeout=120) as http:
        shown = http.post("/tokenize", json={"messages": messages, "tools": [TIME]})
        assert shown.status_code == 200, shown.text
        text = http.post("/detokenize", json={"tokens": shown.json()["tokens"]}).json()["prompt"]
        assert '[call call_7 get_time {"timezone": "CET"}]' in text, text
        assert "12:00[answers call_7]" in text, text
        r = http.post(CHAT, json={"messages": messages, "tools": [TIME], "max_tokens": 4})
        assert r.status_code == 200, r.text
        bad = [*messages[:1], {**messages[1], "tool_calls": [{"id": "x"}]}]
        r = http.post(CHAT, json={"messages": bad, "max_tokens": 4})
        assert r.status_code == 400 and "tool_calls" in r.json()["error"]["param"], r.text


# -- SmolLM2 through the official openai client ------------------------------------------------


@pytest.fixture(scope="module")
def smol(module_spawn: Callable[..., ServerProcess]) -> Iterator[OpenAI]:
    stack = start_stack(
        module_spawn,
        ensure_default_model(),
        dtype="float32",
        num_gpu_blocks=128,
        worker_args=("--warmup-batch-size", "0"),
    )
    procs = Processes()
    try:
        gw = procs.gateway(stack.address)
        with OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0, timeout=300) as c:
            yield c
    finally:
        procs.stop_all()


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_openai_response_format_json_schema(smol: OpenAI) -> None:
    out = smol.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Describe a famous scientist as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        max_tokens=60,
        temperature=0,
    )
    [choice] = out.choices
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def _client_calls(calls: Any) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": c.type,
            "function": {"name": c.function.name, "arguments": c.function.arguments},
        }
        for c in calls
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_openai_forced_tool_calls(smol: OpenAI, choice: str, stream: bool) -> None:
    tool_choice: Any = "required" if choice == "required" else named("get_weather")
    kw: dict[str, Any] = dict(
        model="",
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    if not stream:
        out = smol.chat.completions.create(**kw)
        [c] = out.choices
        assert c.finish_reason == "tool_calls" and c.message.content is None
        calls = _client_calls(c.message.tool_calls)
    else:
        finish = None
        deltas: list[dict[str, Any]] = []
        for chunk in smol.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                assert not c.delta.content
                deltas += [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or []]
        assert finish == "tool_calls"
        calls = merge_calls(deltas)
    assert len(calls) == 1
    check_calls(calls)
    if choice == "named":
        assert calls[0]["function"]["name"] == "get_weather"


def test_openai_guided_choice_and_logit_bias(smol: OpenAI) -> None:
    options = ["positive", "negative", "neutral"]
    out = smol.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Is 'I love this movie' positive or negative?"}],
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": options},
    )
    assert out.choices[0].message.content in options
    kw: dict[str, Any] = dict(
        model="", prompt="The capital of France is", max_tokens=1, temperature=0
    )
    first = smol.completions.create(**kw).choices[0].text
    tokenize = httpx.post(
        str(smol.base_url).replace("/v1/", "/tokenize"),
        json={"prompt": first, "add_special_tokens": False},
    )
    [token] = tokenize.json()["tokens"]
    banned = smol.completions.create(logit_bias={str(token): -100}, **kw).choices[0].text
    assert banned != first
