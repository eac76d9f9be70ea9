"""Chat prompts: the checkpoint's jinja chat template, rendered the way transformers does
(sandboxed, trim_blocks + lstrip_blocks, `raise_exception` and `tojson` available)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedserve.sampling_params import InvalidRequestError


def _raise(message: str) -> None:
    raise InvalidRequestError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> str:
    if template is None:
        raise InvalidRequestError("this model has no chat template; send a plain prompt")
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    try:
        text: str = _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except TemplateError as exc:
        raise InvalidRequestError(f"the chat template failed on these messages: {exc}") from exc
    return text
