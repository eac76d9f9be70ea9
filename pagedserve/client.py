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
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc


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
    req = pb.GenerateRequest(sampling=sampling)
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


def generate_main(a: argparse.Namespace, security: GrpcSecurity = INSECURE) -> int:
    try:
        for msg in _stub(a.control_plane, security).Generate(build_request(a)):
            if a.json:
                print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True)))
            else:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    sys.stdout.write(
                        f"\n[finish_reason={msg.finish_reason} prompt_tokens={msg.prompt_tokens}"
                        f" completion_tokens={msg.completion_tokens}]\n"
                    )
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def stats_main(a: argparse.Namespace, security: GrpcSecurity = INSECURE) -> int:
    try:
        stats = _stub(a.control_plane, security).Stats(pb.StatsRequest(), timeout=10)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
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
