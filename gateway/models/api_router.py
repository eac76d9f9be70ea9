"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.models.serving import model_list
from gateway.openapi import ERRORS
from gateway.schemas import ModelList
from gateway.serving import gateway_of

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request) -> ModelList:
    return await model_list(gateway_of(request))
