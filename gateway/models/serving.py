"""/v1/models: the control plane's models, or the one `--served-model-name` names."""

from __future__ import annotations

from gateway.schemas import ModelCard, ModelList
from gateway.serving import Gateway


async def model_list(gw: Gateway) -> ModelList:
    models = await gw.models()
    served = gw.config.served_model_name
    data = [
        ModelCard(id=served or m.id, created=gw.started, root=m.id, max_model_len=m.max_model_len)
        for m in (models[:1] if served else models)
    ]
    return ModelList(data=data)
