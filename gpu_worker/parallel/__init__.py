"""Tensor parallelism inside a worker: N rank processes on one host, each holding a shard of
the model and of the KV pool, Megatron-style.

    rank 0 (the worker the control plane sees: gRPC, Describe, the Execute stream)
      │ each plan's bytes, over a pipe to every other rank's stdin (`followers.Followers`)
      ▼
    every rank: the same batch from the same plan, its shard of every layer:
      QKV and gate/up column-parallel (its heads, its intermediate columns),
      o_proj and down row-parallel (partial sums, one all-reduce each per layer),
      embedding and LM head vocab-parallel (an all-reduce of the embedded rows, an all-gather
      of the logits), its heads' share of the KV pool (same block ids on every rank)
      │
    rank 0 samples and broadcasts the sampled token ids; every rank appends them.

Every rank is built the same way (`gpu_worker.build.build_worker`); ranks 1..N-1 run their
plans beside their runner (`gpu_worker.follower`) and never import the RPC server.

Collectives are gloo on CPU (NCCL on CUDA) with a time-out; plans travel over pipes, which
have none, so an idle group waits for ever and a group whose rank 0 dies sees end-of-file.
The ranks are always on one host, so everything the group listens on (rank 0's
torch.distributed store, gloo's and NCCL's sockets) listens on loopback only, whatever the
worker's --host: none of it asks who connects.
A rank that dies takes the group down: rank 0 exits when any other rank exits (`Followers`
watches them), and the others exit at end-of-file or when a collective fails.

Here: `group` (this rank's collectives), `pipe` (the frames on a follower's stdin),
`followers` (rank 0's handle on the others). What a rank holds of the model is
`gpu_worker.models.shard`.
"""
