"""The OpenAI-compatible HTTP gateway: FastAPI in front of the control plane's gRPC API.

It never imports torch: everything model-related happens behind the control plane.
"""
