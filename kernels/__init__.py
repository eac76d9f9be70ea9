"""Triton kernels for paged attention (the CUDA data plane; CPU only under TRITON_INTERPRET=1).

envelope           what every kernel supports, and the launchers' shared checks
kv_loop            the shared inner loop: keys through a block table into an online softmax
paged_decode       decode attention, one program per (sequence, kv head)
paged_decode_splitk  decode split into context partitions, merged by log-sum-exp
paged_prefill      varlen prefill / chunked prefill over cached context, causal
reshape_and_cache  scatter new K/V rows into their cache slots
copy_blocks        whole-block copies (copy-on-write)
interpreter_compat a fix the Triton interpreter needs for bf16 dots (CPU runs only)
"""
