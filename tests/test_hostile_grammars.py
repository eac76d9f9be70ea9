"""Constraints meant to hurt: none may take a process down or stall anyone else's stream.

* Past the grammar library's stack (a `$defs` chain 1,000 deep, a Lark chain of 5,000 rules):
  refused with INVALID_ARGUMENT naming the bound, in both planes, before native code sees them.
* Within the bounds, compilation runs on a deep stack, whatever stack its caller has.
* A check that kills its process anyway costs that one request (the control plane's checks
  run in child processes).
* A grammar that fails at its first token: its request fails, and the plans already sent
  ahead for it (async scheduling) leave the worker and every other stream untouched.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from control_plane.grammar_check import GrammarChecker, GrammarCheckUnavailable
from pagedserve import grammar, grammar_bounds
from pagedserve.sampling_params import InvalidRequestError, StructuredOutput
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from protos.v1 import control_plane_pb2 as pb
from tests.procs import ServerProcess
from tests.stack import Stack, request, start_stack


def defs_chain(n: int, through_properties: bool = True) -> str:
    """A schema whose $defs refer one to the next, n deep (94 KB at n = 1,000)."""

    def link(i: int) -> dict[str, object]:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"type": "object", "properties": {"next": ref}} if through_properties else ref

    defs = {f"d{i}": link(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def rule_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"'


def test_the_measure_follows_refs_and_rules() -> None:
    assert grammar_bounds.schema_depth(json.loads(defs_chain(10, through_properties=False))) == 12
    assert grammar_bounds.schema_depth(json.loads(defs_chain(10))) == 22
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    assert grammar_bounds.schema_depth(recursive) == 2  # a reference back ends the path
    assert grammar_bounds.grammar_depth(rule_chain(10)) == 12  # start, r0 ... r10
    # Names inside literals and comments are no references; GBNF's ::= defines too.
    text = 'start: a "b c"\na: /b+/ // c\nb: "x"\nc: b\nroot ::= c'
    assert grammar_bounds.grammar_depth(text) == 3
    # A schema inside a grammar is bounded as a schema.
    with pytest.raises(InvalidRequestError, match="nest more than 512"):
        grammar_bounds.bound("grammar", "grammar", "start: %json " + defs_chain(1000))


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", defs_chain(1000), "json_schema: its subschemas and \\$refs nest more"),
        ("json_schema", defs_chain(2600, through_properties=False), "nest more than 512 deep"),
        ("grammar", rule_chain(5000), "grammar: its rules refer one to the next more than 512"),
    ],
)
def test_constraints_past_the_stack_are_refused_naming_the_bound(
    kind: str, spec: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        grammar.check(StructuredOutput(kind, spec))  # type: ignore[arg-type]


def test_within_the_bounds_compilation_has_a_deep_stack_whatever_its_callers() -> None:
    """A 500-rule chain needs ~2 MiB of the compiler's stack: called from a thread of 512 KiB
    it compiles all the same (on a thread of its own)."""
    code = f"""
import threading
from pagedserve import grammar
from pagedserve.sampling_params import StructuredOutput
threading.stack_size(512 << 10)
out = []
t = threading.Thread(target=lambda: out.append(grammar.check(
    StructuredOutput("grammar", {rule_chain(500)!r}))))
t.start(); t.join()
print("compiled", out)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "compiled [None]" in done.stdout


def test_a_check_that_kills_its_process_costs_that_request_only() -> None:
    """The checker's child dies on one constraint (a stand-in child that crashes where the
    grammar library would): that constraint is refused, and the next is checked by a child
    started in its place."""
    crashes_on_boom = [
        sys.executable,
        "-c",
        "import json, os, signal, sys\n"
        "for line in sys.stdin:\n"
        "    if 'boom' in json.loads(line)['spec']:\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    print(json.dumps({'error': None}), flush=True)\n",
    ]

    async def run() -> list[InvalidRequestError | None]:
        checker = GrammarChecker(1, 60.0, crashes_on_boom)
        try:
            return [
                await checker.check(StructuredOutput("regex", "a+")),
                await checker.check(StructuredOutput("regex", "boom")),
                await checker.check(StructuredOutput("regex", "b+")),
            ]
        finally:
            await checker.close()

    before, crashed, after = asyncio.run(run())
    assert before is None and after is None
    assert crashed is not None and "exited with code -11" in str(crashed)


def test_a_cancelled_check_never_answers_the_next_one() -> None:
    """A client gone while its constraint is being checked: the next constraint that child
    takes gets its own answer, not the late one (the child is replaced)."""
    slow_then_refuses = [
        sys.executable,
        "-c",
        "import json, sys, time\n"
        "for line in sys.stdin:\n"
        "    slow = 'slow' in json.loads(line)['spec']\n"
        "    time.sleep(2 if slow else 0)\n"
        "    print(json.dumps({'error': 'late' if slow else None}), flush=True)\n",
    ]

    async def run() -> InvalidRequestError | None:
        checker = GrammarChecker(1, 60.0, slow_then_refuses)
        try:
            task = asyncio.ensure_future(checker.check(StructuredOutput("regex", "slow")))
            await asyncio.sleep(0.5)
            task.cancel()
            return await checker.check(StructuredOutput("regex", "fast"))
        finally:
            await checker.close()

    assert asyncio.run(run()) is None


def test_a_check_process_that_cannot_start_is_no_verdict() -> None:
    async def run() -> None:
        checker = GrammarChecker(1, 60.0, [sys.executable, "-c", "raise SystemExit(3)"])
        try:
            with pytest.raises(GrammarCheckUnavailable):
                await checker.check(StructuredOutput("regex", "a+"))
        finally:
            await checker.close()

    asyncio.run(run())


def test_the_real_checker_answers_and_refuses() -> None:
    async def run() -> list[InvalidRequestError | None]:
        checker = GrammarChecker(2, 60.0)
        try:
            return list(
                await asyncio.gather(
                    checker.check(StructuredOutput("json_schema", '{"type": "integer"}')),
                    checker.check(StructuredOutput("regex", "(")),
                    checker.check(StructuredOutput("grammar", rule_chain(5000))),
                )
            )
        finally:
            await checker.close()

    ok, bad_regex, deep = asyncio.run(run())
    assert ok is None
    assert bad_regex is not None and "regex does not compile" in str(bad_regex)
    assert deep is not None and "more than 512 deep" in str(deep)


@pytest.fixture(scope="module")
def stack(module_spawn: Callable[..., ServerProcess], micro_llama: Path) -> Stack:
    return start_stack(module_spawn, micro_llama)


def constrained(constraint: common_pb2.StructuredOutput) -> pb.GenerateRequest:
    req = request([1, 2, 3], max_tokens=20, temperature=0.0)
    req.sampling.structured_output.CopyFrom(constraint)
    return req


def test_the_control_plane_refuses_what_would_overflow_and_serves_on(stack: Stack) -> None:
    for constraint in (
        common_pb2.StructuredOutput(json_schema=defs_chain(1000)),
        common_pb2.StructuredOutput(grammar=rule_chain(5000)),
    ):
        with pytest.raises(grpc.RpcError) as err:
            list(stack.stub.Generate(constrained(constraint), timeout=120))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than 512 deep" in (err.value.details() or "")
    assert stack.control_plane.proc.poll() is None
    out = list(stack.stub.Generate(request([1, 2, 3], max_tokens=4, temperature=0.0), timeout=60))
    assert sum(len(c.token_ids) for c in out) == 4


def test_grammars_failing_at_their_first_token_leave_other_streams_alone(stack: Stack) -> None:
    """Each fails its own request (INVALID_ARGUMENT) while a greedy stream runs beside it on
    the same worker: the stream gets every token, and the worker is never given up."""
    tokens: list[int] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def stream() -> None:
        try:
            req = request([1, 5, 9], max_tokens=300, temperature=0.0, ignore_eos=True)
            for chunk in stack.stub.Generate(req, timeout=300):
                tokens.extend(chunk.token_ids)
                started.set()
        except grpc.RpcError as exc:
            errors.append(exc)
            started.set()

    runner = threading.Thread(target=stream)
    runner.start()
    assert started.wait(120)
    hostile = [
        common_pb2.StructuredOutput(json_schema='{"$ref": "#"}'),
        common_pb2.StructuredOutput(json_schema='{"$ref":"#"}'),
        common_pb2.StructuredOutput(json_schema='{"$ref": "#"}'),  # again: no cache hides it
    ]
    codes = []
    for constraint in hostile:
        try:
            list(stack.stub.Generate(constrained(constraint), timeout=120))
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
        time.sleep(0.2)
    runner.join(300)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert not errors and len(tokens) == 300
    assert stack.control_plane.proc.poll() is None and stack.worker.proc.poll() is None


def test_the_worker_refuses_them_too(stack: Stack) -> None:
    """The worker's own compile path (asked directly, as no control plane would) applies the
    same bounds: INVALID_ARGUMENT, and the worker lives on."""
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(stack.worker.address))
    for constraint in (
        common_pb2.StructuredOutput(json_schema=defs_chain(1000)),
        common_pb2.StructuredOutput(grammar=rule_chain(5000)),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.PrepareGrammar(worker_pb2.PrepareGrammarRequest(constraint=constraint), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than 512 deep" in (err.value.details() or "")
    assert stack.worker.proc.poll() is None
