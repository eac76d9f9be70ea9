"""Protobuf <-> domain conversions: the only module besides the servicers that touches `_pb2`.

The scheduler, block manager, model runner and sampler work on `pagedserve.plan` and
`pagedserve.sampling_params` types; these functions translate at the gRPC edge.
"""

from __future__ import annotations

from pagedserve.plan import (
    BeamFork,
    BlockMove,
    CachedRequestData,
    NewRequestData,
    PromptLogprobRun,
    SampledToken,
    StepPlan,
    StepResult,
)
from pagedserve.sampling_params import (
    EarlyStopping,
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from protos.v1 import common_pb2, worker_pb2

_EARLY_STOPPING_TO_PROTO: dict[EarlyStopping, common_pb2.EarlyStopping] = {
    False: common_pb2.EARLY_STOPPING_FALSE,
    True: common_pb2.EARLY_STOPPING_TRUE,
    "never": common_pb2.EARLY_STOPPING_NEVER,
}
_EARLY_STOPPING_FROM_PROTO = {v: k for k, v in _EARLY_STOPPING_TO_PROTO.items()}


def early_stopping_to_proto(value: EarlyStopping) -> common_pb2.EarlyStopping:
    """True, False or "never" as the SamplingParams.early_stopping enum."""
    return _EARLY_STOPPING_TO_PROTO[value]


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.n != 1:
        msg.n = p.n
    if not p.skip_special_tokens:
        msg.skip_special_tokens = False
    msg.include_stop_str_in_output = p.include_stop_str_in_output
    if p.structured is not None:
        msg.structured_output.CopyFrom(structured_to_proto(p.structured))
    msg.logit_bias.extend(common_pb2.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias)
    if p.beam_width:
        msg.beam_width = p.beam_width
        msg.early_stopping = early_stopping_to_proto(p.early_stopping)
        if p.length_penalty != 1.0:
            msg.length_penalty = p.length_penalty
    return msg


def sampling_from_proto(
    msg: common_pb2.SamplingParams, default_max_tokens: int | None = None
) -> SamplingParams:
    """Builds validated SamplingParams; raises InvalidRequestError on bad values."""
    kwargs: dict[str, object] = {}
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "logprobs",
        "prompt_logprobs",
        "n",
        "skip_special_tokens",
    ):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.HasField("max_tokens"):
        kwargs["max_tokens"] = msg.max_tokens
    elif default_max_tokens is not None:
        kwargs["max_tokens"] = default_max_tokens
    if msg.HasField("length_penalty"):
        kwargs["length_penalty"] = msg.length_penalty
    if msg.early_stopping not in _EARLY_STOPPING_FROM_PROTO:
        raise InvalidRequestError(f"early_stopping: unknown value {msg.early_stopping}")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "length_penalty"):
        # float32 on the wire: round-trip 0.9 -> 0.8999999762 is harmless, NaN is not.
        if name in kwargs:
            kwargs[name] = float(kwargs[name])  # type: ignore[arg-type]
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        beam_width=msg.beam_width,
        early_stopping=_EARLY_STOPPING_FROM_PROTO[msg.early_stopping],
        structured=structured_from_proto(msg.structured_output)
        if msg.HasField("structured_output")
        else None,
        logit_bias=tuple((b.token_id, float(b.bias)) for b in msg.logit_bias),
        **kwargs,  # type: ignore[arg-type]
    )


def structured_to_proto(s: StructuredOutput) -> common_pb2.StructuredOutput:
    msg = common_pb2.StructuredOutput()
    if s.kind == "json_object":
        msg.json_object = True
    elif s.kind == "choice":
        msg.choice.choices.extend(s.choice_list)
    else:
        setattr(msg, s.kind, s.spec)
    return msg


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    """Raises InvalidRequestError for an empty or malformed constraint."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequestError("structured_output names no constraint")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput.choices(list(msg.choice.choices))
    return StructuredOutput(kind, getattr(msg, kind))


def _moves_to_proto(moves: list[BlockMove]) -> list[worker_pb2.BlockMove]:
    return [worker_pb2.BlockMove(src=m.src, dst=m.dst) for m in moves]


def _moves_from_proto(msgs: object) -> list[BlockMove]:
    return [BlockMove(m.src, m.dst) for m in msgs]  # type: ignore[attr-defined]


def plan_to_proto(plan: StepPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            worker_pb2.NewRequest(
                req_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                sampling=sampling_to_proto(r.sampling),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in plan.new_requests
        ],
        cached_requests=[
            worker_pb2.CachedRequest(
                req_id=r.req_id, new_block_ids=r.new_block_ids, copied=_moves_to_proto(r.copied)
            )
            for r in plan.cached_requests
        ],
        scheduled_req_ids=list(plan.num_scheduled_tokens.keys()),
        num_scheduled_tokens=list(plan.num_scheduled_tokens.values()),
        finished_req_ids=plan.finished_req_ids,
        swap_out=_moves_to_proto(plan.swap_out),
        swap_in=_moves_to_proto(plan.swap_in),
        copy_blocks=_moves_to_proto(plan.copy_blocks),
        beam_forks=[
            worker_pb2.BeamFork(req_id=f.req_id, src_req_id=f.src_req_id, token_id=f.token_id)
            for f in plan.beam_forks
        ],
    )


def plan_from_proto(msg: worker_pb2.StepPlan) -> StepPlan:
    if len(msg.scheduled_req_ids) != len(msg.num_scheduled_tokens):
        raise ValueError("scheduled_req_ids and num_scheduled_tokens differ in length")
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=list(r.prompt_token_ids),
                output_token_ids=list(r.output_token_ids),
                sampling=sampling_from_proto(r.sampling),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in msg.new_requests
        ],
        cached_requests=[
            CachedRequestData(r.req_id, list(r.new_block_ids), _moves_from_proto(r.copied))
            for r in msg.cached_requests
        ],
        num_scheduled_tokens=dict(
            zip(msg.scheduled_req_ids, msg.num_scheduled_tokens, strict=True)
        ),
        finished_req_ids=list(msg.finished_req_ids),
        swap_out=_moves_from_proto(msg.swap_out),
        swap_in=_moves_from_proto(msg.swap_in),
        copy_blocks=_moves_from_proto(msg.copy_blocks),
        beam_forks=[BeamFork(f.req_id, f.src_req_id, f.token_id) for f in msg.beam_forks],
    )


def logprobs_to_proto(tok: SampledToken, with_id: bool = False) -> common_pb2.TokenLogprobs:
    """The token's logprobs (its id too when asked: prompt logprobs carry no ids beside)."""
    msg = common_pb2.TokenLogprobs(
        logprob=tok.logprob or 0.0, top_token_ids=tok.top_token_ids, top_logprobs=tok.top_logprobs
    )
    if with_id:
        msg.token_id = tok.token_id
        msg.rank = tok.rank
    return msg


def _token_from_proto(token_id: int, lp: common_pb2.TokenLogprobs) -> SampledToken:
    return SampledToken(
        token_id, lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs), lp.rank
    )


def result_to_proto(result: StepResult) -> worker_pb2.StepResult:
    sampled = []
    for req_id, tok in result.sampled.items():
        msg = worker_pb2.SampledToken(req_id=req_id, token_id=tok.token_id)
        if tok.logprob is not None:
            msg.logprobs.CopyFrom(logprobs_to_proto(tok))
        sampled.append(msg)
    prompt = [
        worker_pb2.PromptLogprobs(
            req_id=req_id,
            start=run.start,
            logprobs=[logprobs_to_proto(t, with_id=True) for t in run.logprobs],
        )
        for req_id, run in result.prompt_logprobs.items()
    ]
    return worker_pb2.StepResult(
        step_id=result.step_id,
        sampled=sampled,
        model_time_s=result.model_time_s,
        total_time_s=result.total_time_s,
        prompt_logprobs=prompt,
        failed=[worker_pb2.RequestFailure(req_id=r, message=m) for r, m in result.failed.items()],
        refused=[worker_pb2.RequestFailure(req_id=r, message=m) for r, m in result.refused.items()],
    )


def result_from_proto(msg: worker_pb2.StepResult) -> StepResult:
    sampled: dict[str, SampledToken] = {}
    for s in msg.sampled:
        if s.HasField("logprobs"):
            sampled[s.req_id] = _token_from_proto(s.token_id, s.logprobs)
        else:
            sampled[s.req_id] = SampledToken(token_id=s.token_id)
    prompt = {
        p.req_id: PromptLogprobRun(p.start, [_token_from_proto(t.token_id, t) for t in p.logprobs])
        for p in msg.prompt_logprobs
    }
    return StepResult(
        step_id=msg.step_id,
        sampled=sampled,
        model_time_s=msg.model_time_s,
        total_time_s=msg.total_time_s,
        prompt_logprobs=prompt,
        failed={f.req_id: f.message for f in msg.failed},
        refused={f.req_id: f.message for f in msg.refused},
    )
