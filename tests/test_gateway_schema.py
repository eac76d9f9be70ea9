"""Schemathesis against the gateway's own OpenAPI schema, valid and invalid inputs alike:
nothing it sends may produce a 5xx. The example count is bounded (and derandomized) so the run
stays short and repeatable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from tests.gateway_stack import GatewayStack, shared_gateway_stack

EXAMPLES = {"POST": 25, "GET": 5}
# Keeps each generated request cheap on CPU; clamping leaves valid values valid.
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "min_tokens": 8}


@pytest.fixture(scope="module")
def gs(pytestconfig: pytest.Config, micro_llama: Path) -> GatewayStack:
    return shared_gateway_stack(pytestconfig, micro_llama)


def _bound(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 8 and all(isinstance(p, str) for p in prompt):
        body["prompt"] = prompt[:8]


def operations(gs: GatewayStack) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{gs.url}/openapi.json", headers=gs.headers)
    ops = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result.err()
        ops.append(result.ok())
    return ops


def test_schema_lists_the_openai_routes(gs: GatewayStack) -> None:
    paths = {op.path for op in operations(gs)}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= paths


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(gs: GatewayStack, mode: GenerationMode) -> None:
    statuses: list[int] = []
    for op in operations(gs):
        examples = EXAMPLES.get(op.method.upper(), 5)
        if mode is GenerationMode.NEGATIVE:
            if op.method.upper() != "POST":
                continue  # nothing to get wrong in a bare GET
            examples //= 2

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:
            _bound(case.body)
            response = case.call(base_url=gs.url, headers=gs.headers, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code} "
                f"{response.text[:500]}"
            )

        run()
    assert gs.wait_all_blocks_free(5.0)
    if mode is GenerationMode.POSITIVE:
        assert statuses.count(200) >= 20  # the success path was exercised, not just rejections
