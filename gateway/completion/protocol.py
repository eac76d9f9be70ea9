"""The /v1/completions body: OpenAI's legacy completions, with vLLM's extensions."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gateway.errors import bad_request
from gateway.protocol import INTEGRAL, MAX_PROMPT_TOKEN_IDS, TokenIds, bounded, check_count
from gateway.sampling import SamplingFields

MAX_CHOICES = 256  # prompts x n in one request


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[
            list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)
        ]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, bounded("logprobs"), INTEGRAL] | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    MAX_COUNTS = {"prompt": (MAX_PROMPT_TOKEN_IDS, "token ids")}

    @classmethod
    def check_counts(cls, data: dict[str, Any]) -> None:
        super().check_counts(data)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            for ids in prompt:  # a batch: each prompt on its own
                check_count("prompt", ids, MAX_PROMPT_TOKEN_IDS, "token ids in one prompt")

    def prompts(self) -> list[str] | list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]

    def beam_search_conflicts(self) -> list[tuple[str, Any]]:
        out = super().beam_search_conflicts()
        if self.logprobs is not None:
            out.append(("logprobs", self.logprobs))
        return out

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise bad_request(f"prompts x n must not exceed {MAX_CHOICES}", "n")
