"""The worker process: owns the model, the physical KV block pool and the forward pass."""
