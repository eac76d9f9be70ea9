"""GET /v1/models: its serving and its route."""
