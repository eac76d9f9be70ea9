"""The control plane: admission, scheduling and the logical side of KV-cache paging.

`request`, `block_manager` and `scheduler` are pure bookkeeping (no I/O, no tensors); the gRPC
servers and the scheduler loop that drive them live beside them.
"""
