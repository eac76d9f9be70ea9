"""Errors a user reads, written for them: a float bound in a 400 as 1.18e-38 rather than its
40 digits; a truncated or corrupt GGUF named as such, without numpy's words."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.completion.protocol import CompletionRequest
from gateway.errors import install_handlers
from pagedserve.gguf import GGUFError, open_gguf
from tests.gguf_files import Q, write_gguf


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


NUMPY_WORDS = ("index", "axis", "reshape", "dtype", "unpack", "bounds")


@pytest.fixture(scope="module")
def gguf_bytes(micro_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("gguf") / "micro.gguf"
    return write_gguf(micro_llama, out, lambda name, shape: Q.F32).read_bytes()


@pytest.mark.parametrize("keep", [1, 4, 24, 100, 1000, 0.5, -1])
def test_a_truncated_gguf_is_named_as_such(gguf_bytes: bytes, tmp_path: Path, keep: float) -> None:
    n = int(len(gguf_bytes) * keep) if isinstance(keep, float) else keep % len(gguf_bytes)
    file = tmp_path / "model.gguf"
    file.write_bytes(gguf_bytes[:n])
    with pytest.raises(GGUFError) as info:
        open_gguf(file)
    message = str(info.value)
    assert message.startswith(f"{file} is truncated or corrupt"), message
    assert not any(word in message for word in NUMPY_WORDS), message


def test_a_file_that_is_no_gguf_says_so(tmp_path: Path) -> None:
    empty, text = tmp_path / "empty.gguf", tmp_path / "text.gguf"
    empty.write_bytes(b"")
    text.write_text("<html>not found</html>")
    with pytest.raises(GGUFError, match=f"^{empty} is empty"):
        open_gguf(empty)
    with pytest.raises(GGUFError, match=f"^{text} is not a GGUF file"):
        open_gguf(text)
