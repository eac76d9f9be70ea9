"""Errors a user reads, written for them: a float bound in a 400 as 1.18e-38 rather than its
40 digits."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.errors import install_handlers
from gateway.protocol import CompletionRequest


@pytest.fixture(scope="module")
def client() -> TestClient:
    """The gateway's error handlers over its completion body, with nothing behind them."""
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, str]:
        return {}

    return TestClient(app)


@pytest.mark.parametrize("field", ["repetition_penalty", "top_p"])
def test_a_tiny_minimum_is_written_short(client: TestClient, field: str) -> None:
    reply = client.post("/v1/completions", json={"prompt": "x", field: 0})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == field
    assert error["message"] == f"{field}: Input should be greater than or equal to 1.18e-38"


def test_a_plain_bound_keeps_its_message(client: TestClient) -> None:
    reply = client.post("/v1/completions", json={"prompt": "x", "repetition_penalty": 101})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "repetition_penalty: Input should be less than or equal to 100"
    )
