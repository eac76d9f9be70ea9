"""Structured output on the default SmolLM2 model through real processes: every output parses
and validates against its constraint, at temperature 0 and 0.8, with n = 1 and n = 4; a
constrained batch leaves unconstrained requests' tokens unchanged; constraints survive
preemption and a lost worker; bad constraints are refused before reaching a worker."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pagedserve.cli.model_source import ensure_default_model
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from tests.json_schemas import (
    CHOICES,
    GRAMMARS,
    REGEXES,
    SCHEMAS,
    check_choice,
    check_grammar,
    check_regex,
    check_schema,
)
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


def constrained(
    stack: Stack, prompt: str, constraint: common_pb2.StructuredOutput, **kw: Any
) -> list[str]:
    req = pb.GenerateRequest(output_kind=pb.OUTPUT_KIND_FINAL_ONLY)
    req.chat.messages.add(role="user", content=prompt)
    req.sampling.max_tokens = kw.pop("max_tokens", 200)
    req.sampling.structured_output.CopyFrom(constraint)
    for key, value in kw.items():
        setattr(req.sampling, key, value)
    for attempt in range(60):
        try:
            chunks = list(stack.stub.Generate(req, timeout=600))
            break
        except grpc.RpcError as exc:
            # The worker's compile queue is full: "retry shortly", as a client is told to.
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == 59:
                raise
            time.sleep(0.5)
    by_index: dict[int, str] = {}
    for c in chunks:
        by_index[c.index] = by_index.get(c.index, "") + c.text
        assert c.finish_reason in ("", "stop"), (prompt, by_index[c.index])
    return [by_index[i] for i in sorted(by_index)]


@pytest.fixture(scope="module")
def stack(module_spawn: Callable[..., ServerProcess]) -> Stack:
    # 74 requests at once (37 schemas, each greedy and with n = 4), each up to 512 tokens: all
    # may wait (the default limit counts what the pool holds at full length and would
    # answer 429). The dtype users get (`auto`: bf16 where the CPU has it): a constraint holds
    # whatever the dtype, and bf16 halves the time these hundreds of answers take.
    return start_stack(
        module_spawn,
        ensure_default_model(),
        dtype="auto",
        num_gpu_blocks=2048,
        cp_args=("--max-waiting", "256"),
    )


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


SETTINGS = [(0.0, 1), (0.8, 4)]  # (temperature, n)


def _check_all(stack: Stack, jobs: list[tuple[str, common_pb2.StructuredOutput, Any]]) -> None:
    """Runs every (prompt, constraint, check) greedily and sampled at temperature 0.8 with
    n = 4, all at once; every output must pass its check."""
    work = [(p, c, check, t, n) for p, c, check in jobs for t, n in SETTINGS]
    with ThreadPoolExecutor(len(work)) as pool:
        futures = [
            pool.submit(constrained, stack, p, c, temperature=t, n=n, max_tokens=512)
            for p, c, _, t, n in work
        ]
        failures = []
        for (p, _, check, t, n), f in zip(work, futures, strict=True):
            outs = f.result()
            assert len(outs) == n
            failures += [(p, t, text) for text in outs if not check(text)]
    assert not failures, failures[:5]


def test_every_schema_holds(stack: Stack) -> None:
    """37 schemas: nested objects, arrays with bounds, enums, ranges, patterns, formats,
    optional fields, anyOf, $ref/$defs; each greedy and at temperature 0.8 with n = 4."""
    assert len(SCHEMAS) >= 30
    _check_all(
        stack,
        [
            (
                f"Give an example {name.replace('_', ' ')} as JSON.",
                common_pb2.StructuredOutput(json_schema=json.dumps(schema)),
                lambda text, schema=schema: check_schema(schema, text),
            )
            for name, schema in SCHEMAS
        ],
    )


def test_every_regex_choice_and_grammar_holds(stack: Stack) -> None:
    jobs: list[tuple[str, common_pb2.StructuredOutput, Any]] = []
    for name, regex in REGEXES:
        c = common_pb2.StructuredOutput(regex=regex)
        jobs.append((f"Give an example {name}.", c, lambda t, r=regex: check_regex(r, t)))
    for name, options in CHOICES:
        c = common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=options))
        jobs.append((f"Pick a {name}.", c, lambda t, o=options: check_choice(o, t)))
    for name, grammar in GRAMMARS:
        c = common_pb2.StructuredOutput(grammar=grammar)
        jobs.append((f"Write an example {name}.", c, lambda t, g=name: check_grammar(g, t)))
    _check_all(stack, jobs)


def test_sampling_params_refuse_what_a_constraint_cannot_honour() -> None:
    from pagedserve.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput

    c = StructuredOutput("regex", "[a-z]+")
    with pytest.raises(InvalidRequestError, match="takes no ignore_eos"):
        SamplingParams(structured=c, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="takes no min_tokens"):
        SamplingParams(structured=c, min_tokens=3)
    with pytest.raises(InvalidRequestError, match="names a token id twice"):
        SamplingParams(logit_bias=((5, 1.0), (5, 2.0)))
    with pytest.raises(InvalidRequestError, match=r"must be in \[-100, 100\]"):
        SamplingParams(logit_bias=((5, 101.0),))


def test_bad_constraints_are_refused(stack: Stack) -> None:
    for c, words in (
        (common_pb2.StructuredOutput(regex="(("), "regex does not compile"),
        (common_pb2.StructuredOutput(json_schema='{"type": "strin"}'), "json_schema"),
        (common_pb2.StructuredOutput(json_schema="{"), "not valid JSON"),
        (common_pb2.StructuredOutput(grammar="root ::= item\n"), "grammar does not compile"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            constrained(stack, "x", c)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert words in info.value.details(), info.value.details()


def _greedy(stack: Stack, prompt: str, max_tokens: int = 24) -> list[int]:
    req = pb.GenerateRequest(output_kind=pb.OUTPUT_KIND_FINAL_ONLY)
    req.chat.messages.add(role="user", content=prompt)
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    return [t for c in stack.stub.Generate(req, timeout=600) for t in c.token_ids]


PLAIN = ["Name three colors.", "What is 2 + 2?", "Say hello in French.", "Count to five."]


def _valid_json(text: str) -> None:
    import jsonschema

    jsonschema.validate(json.loads(text), SCHEMA)


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(
    spawn: Callable[..., ServerProcess],
) -> None:
    """float64, so that a different batch cannot move a greedy choice by rounding."""
    stack = start_stack(spawn, ensure_default_model(), dtype="float64", num_gpu_blocks=256)
    alone = [_greedy(stack, p) for p in PLAIN]
    c = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    with ThreadPoolExecutor(8) as pool:
        mixed = [pool.submit(_greedy, stack, p) for p in PLAIN]
        json_outs = [
            pool.submit(constrained, stack, "Describe a person as JSON.", c, temperature=0.8, n=2)
            for _ in range(4)
        ]
        assert [f.result() for f in mixed] == alone
        for f in json_outs:
            for text in f.result():
                _valid_json(text)


def test_constraints_survive_preemption(spawn: Callable[..., ServerProcess]) -> None:
    # 24 blocks of 16 tokens for 8 requests of ~40 + 200 tokens: preemption is certain.
    stack = start_stack(
        spawn,
        ensure_default_model(),
        dtype="auto",
        num_gpu_blocks=24,
        cp_args=("--max-waiting", "64"),
    )
    c = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(constrained, stack, f"Describe person {i} as JSON.", c, temperature=0.8)
            for i in range(8)
        ]
        for f in futures:
            for text in f.result():
                _valid_json(text)
    assert stack.stats().workers[0].num_preemptions > 0


def test_constraints_survive_a_lost_worker(spawn: Callable[..., ServerProcess]) -> None:
    stack = start_stack(
        spawn,
        ensure_default_model(),
        dtype="auto",
        num_workers=2,
        cp_args=("--worker-failover-timeout", "1"),
    )
    long_schema = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "string", "pattern": "[a-z]{10,30}"},
                "minItems": 5,
                "maxItems": 5,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    }
    c = common_pb2.StructuredOutput(json_schema=json.dumps(long_schema))

    def run(i: int) -> list[str]:
        return constrained(stack, f"List five words ({i}).", c, temperature=0.8, max_tokens=400)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(run, i) for i in range(6)]
        # Placement may put every request on one worker (their prompts share the template's
        # head): the worker to kill is whichever runs the most once generation is under way.
        deadline = time.monotonic() + 120
        while True:
            workers = stack.stats().workers
            if sum(w.num_steps for w in workers) >= 10 and max(w.num_running for w in workers):
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busiest = max(workers, key=lambda w: w.num_running).address
        lost = next(w for w in stack.workers if w.address == busiest)
        lost.proc.kill()
        lost.proc.wait()
        import jsonschema

        for f in futures:
            for text in f.result(timeout=300):
                jsonschema.validate(json.loads(text), long_schema)
