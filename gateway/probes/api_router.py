"""The probes, which answer without the API key (`middleware.OPEN_PATHS`): GET /version,
/health and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.errors import APIError
from gateway.openapi import ERRORS
from gateway.probes.serving import metrics_text
from gateway.schemas import HealthStatus, VersionResponse
from gateway.serving import gateway_of
from pagedserve import __version__

router = APIRouter()


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


@router.get("/health", response_model=HealthStatus, responses={503: ERRORS[503]})
async def health(request: Request) -> JSONResponse:
    """200 while the control plane serves and at least one worker is healthy."""
    if await gateway_of(request).upstream.serving():
        return JSONResponse({"status": "ok"})
    return APIError(
        503, "the control plane or its workers are not serving", type="server_error"
    ).response()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(await metrics_text(gateway_of(request)), media_type=CONTENT_TYPE_LATEST)
