"""`pagedserve generate` and `pagedserve stats`: command-line clients of the control plane."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from pagedserve.grpc_security import INSECURE, GrpcSecurity, channel
from pagedserve.sampling_params import EarlyStopping
from pagedserve.wire import early_stopping_to_proto
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc

_EARLY_STOPPING: dict[str, EarlyStopping] = {"false": False, "true": True, "never": "never"}


def _stub(address: str, security: GrpcSecurity) -> pb_grpc.ControlPlaneStub:
    return pb_grpc.ControlPlaneStub(channel(address, security))


def build_request(a: argparse.Namespace) -> pb.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        stop=a.stop,
        ignore_eos=a.ignore_eos,
    )
    for name in ("top_p", "top_k", "seed", "logprobs"):
        value = getattr(a, name)
        if value is not None:
            setattr(sampling, name, value)
    if a.n != 1:
        sampling.n = a.n
    if a.beam_width:
        sampling.beam_width = a.beam_width
        sampling.early_stopping = early_stopping_to_proto(_EARLY_STOPPING[a.early_stopping])
        if a.length_penalty != 1.0:
            sampling.length_penalty = a.length_penalty
    req = pb.GenerateRequest(sampling=sampling)
    if a.n > 1 or a.beam_width:  # printed whole, one completion after the other
        req.output_kind = pb.OUTPUT_KIND_FINAL_ONLY
    if a.prompt_ids is not None:
        req.token_ids.ids.extend(int(t) for t in a.prompt_ids.split(",") if t.strip())
    elif a.chat is not None:
        req.chat.messages.add(role="user", content=a.chat)
        req.chat.add_generation_prompt = True
    else:
        req.text = a.prompt
        req.add_special_tokens = a.add_special_tokens
    return req


def message_to_dict(msg: Message) -> dict[str, Any]:
    """Every field of msg, zeros included, with numbers as numbers: unlike MessageToDict,
    which leaves zeros out and writes 64-bit integers as strings."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None:
            value = [message_to_dict(v) for v in value] if f.is_repeated else message_to_dict(value)
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def _print_rpc_error(exc: grpc.RpcError, token_source: str) -> None:
    """The status on one line; a refused token adds where it came from or was looked for."""
    print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED and token_source:
        print(f"pagedserve: {token_source}", file=sys.stderr)


def generate_main(
    a: argparse.Namespace, security: GrpcSecurity = INSECURE, token_source: str = ""
) -> int:
    """Streams one completion's text as it comes; several (--n, --beam-width) are printed
    whole when all have ended, in index order: for beam search, best first with scores.
    `token_source` says where the gRPC token came from, for a server that refuses it."""
    req = build_request(a)
    whole = req.output_kind == pb.OUTPUT_KIND_FINAL_ONLY
    completions: dict[int, list[pb.GenerateResponse]] = {}
    try:
        for msg in _stub(a.control_plane, security).Generate(req):
            if a.json:
                print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True)))
            elif whole:
                completions.setdefault(msg.index, []).append(msg)
            else:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    sys.stdout.write(f"\n{_summary(msg)}\n")
    except grpc.RpcError as exc:
        _print_rpc_error(exc, token_source)
        return 1
    for index, msgs in sorted(completions.items()):
        last = msgs[-1]
        score = f" score={last.sequence_score:.6f}" if last.HasField("sequence_score") else ""
        print(f"=== {index}{score}")
        print("".join(m.text for m in msgs))
        print(_summary(last))
    return 0


def _summary(msg: pb.GenerateResponse) -> str:
    return (
        f"[finish_reason={msg.finish_reason} prompt_tokens={msg.prompt_tokens}"
        f" completion_tokens={msg.completion_tokens}]"
    )


def stats_main(
    a: argparse.Namespace, security: GrpcSecurity = INSECURE, token_source: str = ""
) -> int:
    try:
        stats = _stub(a.control_plane, security).Stats(pb.StatsRequest(), timeout=10)
    except grpc.RpcError as exc:
        _print_rpc_error(exc, token_source)
        return 1
    d = message_to_dict(stats)
    if a.json:
        print(json.dumps(d, indent=2))
        return 0
    workers = d.pop("workers", [])
    for key, value in d.items():
        print(f"{key:28s} {value}")
    for w in workers:
        print(f"worker {w['address']}:")
        for key, value in w.items():
            if key != "address":
                print(f"  {key:26s} {value}")
    return 0
