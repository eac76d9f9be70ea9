"""The probes GET /version, /health and /metrics: their serving and their routes."""
