"""Domain errors as gRPC status codes: the one place the control plane's service maps them."""

from __future__ import annotations

import grpc

from control_plane.plane import AdmissionError
from control_plane.worker_client import WorkerError, WorkerRefusal
from pagedserve.sampling_params import InvalidRequestError


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, AdmissionError):
        return exc.code, str(exc)
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, WorkerError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, WorkerRefusal):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
