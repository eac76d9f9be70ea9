"""/v1/completions: the body's prompts as Generate calls (one per prompt, its n choices forked
by the control plane), echo and prompt logprobs, the request budget, and the response."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from gateway.choices import Choice, expand_choices
from gateway.completion.protocol import CompletionRequest
from gateway.middleware import request_id_of
from gateway.responses import CompletionFormat
from gateway.sampling import beam_search_proto, sampling_proto
from gateway.serving import Gateway
from pagedserve.sampling_params import DEFAULT_MAX_TOKENS
from protos.v1 import control_plane_pb2 as pb

# Token ids copied into a protobuf per call. The body's prompts are made into protobufs off
# the event loop (gateway.bodies), where a call that holds the GIL long stalls the loop as
# long: a million ids in one call held it for 25 ms.
_IDS_PER_CALL = 1 << 16


def prompt_requests(body: CompletionRequest) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt, holding only the prompt (text or token ids)."""
    out = []
    for prompt in body.prompts():
        req = pb.GenerateRequest(add_special_tokens=body.add_special_tokens)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            for start in range(0, len(prompt), _IDS_PER_CALL):
                req.token_ids.ids.extend(prompt[start : start + _IDS_PER_CALL])
        out.append(req)
    return out


async def create_completion(
    gw: Gateway, request: Request, body: CompletionRequest, prompts: list[pb.GenerateRequest]
) -> Response:
    """The completion of `prompts` (`prompt_requests` of the body), whole or streamed."""
    shown, upstream_model = await gw.model_names(body.model)
    rid = request_id_of(request.scope)
    sampling = sampling_proto(body, body.logprobs)
    beam_search_proto(body, sampling)
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens carry logprobs
        sampling.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
    prompt_entries = 0  # every choice carries its prompt's logprobs
    if sampling.HasField("prompt_logprobs"):
        for prompt in prompts:
            count = (
                len(prompt.token_ids.ids)
                if prompt.HasField("token_ids")
                else await gw.prompt_length(prompt.text, body.add_special_tokens)
            )
            prompt_entries += body.n * count * (1 + sampling.prompt_logprobs)
    gw.budget.check(
        len(prompts),
        body.n,
        body.max_tokens or DEFAULT_MAX_TOKENS,
        body.logprobs,
        prompt_entries,
    )
    single = len(prompts) == 1
    choices: list[Choice] = []
    echo: dict[int, str] = {}
    for i, base in enumerate(prompts):
        base.model = upstream_model
        base.sampling.CopyFrom(sampling)
        if body.echo:
            text = (
                await gw.prompt_text(base.token_ids.ids)
                if base.HasField("token_ids")
                else base.text
            )
            echo.update(dict.fromkeys(range(i * body.n, (i + 1) * body.n), text))
        choices += expand_choices(base, body.n, i * body.n, rid, single)
    fmt = CompletionFormat(f"cmpl-{rid}", shown, body.logprobs, echo, body.n, body.prompt_logprobs)
    return await gw.run(request, body, choices, fmt)
