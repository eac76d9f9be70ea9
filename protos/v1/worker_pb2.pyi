from protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareGrammarRequest(_message.Message):
    __slots__ = ("constraint",)
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    constraint: _common_pb2.StructuredOutput
    def __init__(self, constraint: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class PrepareGrammarResponse(_message.Message):
    __slots__ = ("compile_s",)
    COMPILE_S_FIELD_NUMBER: _ClassVar[int]
    compile_s: float
    def __init__(self, compile_s: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "model_path", "architecture", "dtype", "device", "block_size", "num_gpu_blocks", "num_cpu_blocks", "max_model_len", "eos_token_ids", "epoch", "vocab_size", "attention_backend", "kv_cache_bytes", "kv_cache_dtype", "cpu_bf16_isa", "tensor_parallel_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CPU_BF16_ISA_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    architecture: str
    dtype: str
    device: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    vocab_size: int
    attention_backend: str
    kv_cache_bytes: int
    kv_cache_dtype: str
    cpu_bf16_isa: str
    tensor_parallel_size: int
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., vocab_size: _Optional[int] = ..., attention_backend: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., cpu_bf16_isa: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class BlockMove(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling", "block_ids", "num_computed_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("req_id", "new_block_ids", "copied")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIED_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copied: _containers.RepeatedCompositeFieldContainer[BlockMove]
    def __init__(self, req_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., copied: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ...) -> None: ...

class BeamFork(_message.Message):
    __slots__ = ("req_id", "src_req_id", "token_id")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    src_req_id: str
    token_id: int
    def __init__(self, req_id: _Optional[str] = ..., src_req_id: _Optional[str] = ..., token_id: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "scheduled_req_ids", "num_scheduled_tokens", "finished_req_ids", "swap_out", "swap_in", "copy_blocks", "beam_forks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BEAM_FORKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    scheduled_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockMove]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockMove]
    copy_blocks: _containers.RepeatedCompositeFieldContainer[BlockMove]
    beam_forks: _containers.RepeatedCompositeFieldContainer[BeamFork]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., scheduled_req_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., swap_out: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ..., copy_blocks: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ..., beam_forks: _Optional[_Iterable[_Union[BeamFork, _Mapping]]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("req_id", "token_id", "logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_id: int
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, req_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "start", "logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, req_id: _Optional[str] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "model_time_s", "total_time_s", "prompt_logprobs", "failed", "refused")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    MODEL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    model_time_s: float
    total_time_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    failed: _containers.RepeatedCompositeFieldContainer[RequestFailure]
    refused: _containers.RepeatedCompositeFieldContainer[RequestFailure]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., model_time_s: _Optional[float] = ..., total_time_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[RequestFailure, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[RequestFailure, _Mapping]]] = ...) -> None: ...

class RequestFailure(_message.Message):
    __slots__ = ("req_id", "message")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    message: str
    def __init__(self, req_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
