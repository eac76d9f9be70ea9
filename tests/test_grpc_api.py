"""The ControlPlane contract over real gRPC: seeded sampling, stops, abort, admission."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from protos.v1 import control_plane_pb2 as pb
from tests.procs import ServerProcess
from tests.stack import Stack, generate, request, start_stack, wait_all_free

NUM_GPU_BLOCKS = 64  # 1024 token slots: less than the model's 2048-token context


@pytest.fixture(scope="module")
def stack(module_spawn: Callable[..., ServerProcess], micro_llama: Path) -> Stack:
    return start_stack(module_spawn, micro_llama, num_gpu_blocks=NUM_GPU_BLOCKS)


def test_list_models_and_text_prompt(stack: Stack, micro_llama: Path) -> None:
    models = stack.stub.ListModels(pb.ListModelsRequest()).models
    assert [m.id for m in models] == [micro_llama.name]
    assert models[0].max_model_len == 2048
    out = generate(stack.stub, "Hello there", max_tokens=12, temperature=0.0, ignore_eos=True)
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.chunks[-1].completion_tokens == 12
    assert out.chunks[-1].prompt_tokens == len(
        Tokenizer.from_file(str(micro_llama / "tokenizer.json"))
        .encode("Hello there", add_special_tokens=True)  # BOS by default, as over HTTP
        .ids
    )


def test_seeded_sampling_same_alone_and_in_busy_batch(stack: Stack) -> None:
    kw = dict(max_tokens=40, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    prompt = list(range(10, 40))
    alone = generate(stack.stub, prompt, **kw).token_ids
    again = generate(stack.stub, prompt, **kw).token_ids
    assert alone == again

    def noise(i: int) -> list[int]:
        return generate(
            stack.stub,
            list(range(50 + i, 90 + 3 * i)),
            max_tokens=60,
            temperature=1.3,
            ignore_eos=True,
        ).token_ids

    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(noise, i) for i in range(8)]
        busy = pool.submit(lambda: generate(stack.stub, prompt, **kw).token_ids)
        assert busy.result() == alone
        for f in others:
            f.result()
    other_seed = generate(stack.stub, prompt, **{**kw, "seed": 43}).token_ids
    assert other_seed != alone


def _clean_piece(tok: Tokenizer, ids: list[int], k: int) -> str:
    return tok.decode(ids[: k + 1])[len(tok.decode(ids[:k])) :]


def test_stop_string_spanning_tokens(stack: Stack, micro_llama: Path) -> None:
    tok = Tokenizer.from_file(str(micro_llama / "tokenizer.json"))
    prompt = list(range(100, 130))
    full = generate(stack.stub, prompt, max_tokens=60, temperature=0.0, ignore_eos=True)
    ids = full.token_ids
    # A stop string made of the last char of token k and the first char of token k + 1.
    for k in range(5, len(ids) - 1):
        a, b = _clean_piece(tok, ids, k), _clean_piece(tok, ids, k + 1)
        if a.isprintable() and b.isprintable() and a and b and "\ufffd" not in a + b:
            prefix = tok.decode(ids[: k + 1])
            stop = a[-1] + b[0]
            cut = prefix[:-1] + stop
            if full.text.find(stop) == len(prefix) - 1 and full.text.startswith(cut):
                break
    else:
        pytest.skip("no clean token boundary in this output")
    out = generate(stack.stub, prompt, max_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: len(prefix) - 1]
    assert all(stop not in c.text for c in out.chunks)
    assert out.token_ids == ids[: k + 2]


def test_stop_token_ids(stack: Stack) -> None:
    prompt = list(range(200, 220))
    full = generate(stack.stub, prompt, max_tokens=30, temperature=0.0, ignore_eos=True)
    stop_id = full.token_ids[7]
    j = full.token_ids.index(stop_id)
    out = generate(
        stack.stub,
        prompt,
        max_tokens=30,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[stop_id],
    )
    assert out.token_ids == full.token_ids[: j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == str(stop_id)


def test_cancel_mid_stream_frees_blocks(stack: Stack) -> None:
    call = stack.stub.Generate(
        request(list(range(5, 105)), max_tokens=900, temperature=0.0, ignore_eos=True)
    )
    got = 0
    for _ in call:
        got += 1
        if got == 3:
            break
    assert stack.stats().workers[0].num_free_gpu_blocks < NUM_GPU_BLOCKS
    call.cancel()
    stats = wait_all_free(stack)
    assert stats.workers[0].num_free_gpu_blocks == NUM_GPU_BLOCKS
    assert stats.num_running == 0


def test_abort_rpc(stack: Stack) -> None:
    call = stack.stub.Generate(
        request(
            list(range(5, 105)),
            request_id="to-abort",
            max_tokens=900,
            temperature=0.0,
            ignore_eos=True,
        )
    )
    first = next(call)
    assert first.request_id == "to-abort"
    assert stack.stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    last = list(call)[-1]
    assert last.finish_reason == "abort"
    assert wait_all_free(stack).workers[0].num_free_gpu_blocks == NUM_GPU_BLOCKS
    assert not stack.stub.Abort(pb.AbortRequest(request_id="to-abort")).found


@pytest.mark.parametrize("kind", [pb.OUTPUT_KIND_DELTA, pb.OUTPUT_KIND_FINAL_ONLY])
def test_abort_ends_every_completion_with_its_own_count(
    stack: Stack, micro_llama: Path, kind: int
) -> None:
    generated_before = stack.stats().workers[0].num_generated_tokens
    call = stack.stub.Generate(
        request(
            list(range(5, 105)),
            request_id=f"abort-n3-{kind}",
            n=3,
            max_tokens=900,
            temperature=1.0,
            seed=1,
            ignore_eos=True,
            output_kind=kind,
        )
    )
    # Wait until every completion has tokens (the three decode in the same steps), then abort.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        w = stack.stats().workers[0]
        if w.num_running >= 3 and w.num_generated_tokens >= generated_before + 6:
            break
        time.sleep(0.02)
    assert stack.stub.Abort(pb.AbortRequest(request_id=f"abort-n3-{kind}")).found
    msgs = list(call)
    ended = {m.index: m for m in msgs if m.finish_reason}
    assert sorted(ended) == [0, 1, 2] and {m.finish_reason for m in ended.values()} == {"abort"}
    for i, m in ended.items():  # each completion's own token count, not the request's total
        assert m.completion_tokens == sum(len(x.token_ids) for x in msgs if x.index == i)
    if kind == pb.OUTPUT_KIND_FINAL_ONLY:  # and its text, decoded once at the abort
        tok = Tokenizer.from_file(str(micro_llama / "tokenizer.json"))
        for m in ended.values():
            assert m.token_ids and m.text.strip() == tok.decode(list(m.token_ids)).strip()
    assert msgs[-1].finish_reason == "abort"
    wait_all_free(stack)


@pytest.mark.parametrize(
    ("prompt", "kw", "code", "needle"),
    [
        ([3 + i % 500 for i in range(2048)], {}, "INVALID_ARGUMENT", "maximum context length"),
        (list(range(3, 103)), {"max_tokens": 2000}, "INVALID_ARGUMENT", "maximum context"),
        (list(range(3, 503)), {"max_tokens": 1000}, "INVALID_ARGUMENT", "KV cache"),
        ([], {}, "INVALID_ARGUMENT", "prompt"),
        ("", {}, "INVALID_ARGUMENT", "empty"),
        ([1, 2, 99999], {}, "INVALID_ARGUMENT", "vocab"),
        ([5, 6], {"temperature": -1.0}, "INVALID_ARGUMENT", "temperature"),
        ([5, 6], {"top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
        ([5, 6], {"max_tokens": 0}, "INVALID_ARGUMENT", "max_tokens"),
        ([5, 6], {"logprobs": 100}, "INVALID_ARGUMENT", "logprobs"),
    ],
)
def test_admission_errors(stack: Stack, prompt: object, kw: dict, code: str, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.stub, prompt, **kw)  # type: ignore[arg-type]
    assert err.value.code().name == code
    assert needle in (err.value.details() or "")
    # The server is unharmed.
    assert generate(stack.stub, [5, 6, 7], max_tokens=2, ignore_eos=True).finish_reason


def test_reserved_request_id_characters(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.stub, [5, 6], max_tokens=2, request_id="x#0")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_n16_streams_every_index_and_frees_its_blocks(stack: Stack) -> None:
    from tests.stack import request as make_request

    req = make_request([5, 6, 7], max_tokens=2, n=16, request_id="too-many")
    out = list(stack.stub.Generate(req))
    assert {m.index for m in out} == set(range(16))
    assert wait_all_free(stack).workers[0].num_free_gpu_blocks == NUM_GPU_BLOCKS


def test_final_only_output_is_the_streamed_output_in_one_message(stack: Stack) -> None:
    kw = dict(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True, logprobs=2)
    prompt = list(range(20, 60))
    streamed = generate(stack.stub, prompt, **kw)
    assert len(streamed.chunks) > 1
    final = generate(stack.stub, prompt, output_kind=pb.OUTPUT_KIND_FINAL_ONLY, **kw)
    [msg] = final.chunks
    assert (final.token_ids, final.text) == (streamed.token_ids, streamed.text)
    # float32 logits of one row vary in the last bits with the batch around it
    assert [lp.logprob for lp in msg.logprobs] == pytest.approx(
        [lp.logprob for c in streamed.chunks for lp in c.logprobs], abs=1e-4
    )
    assert (msg.finish_reason, msg.completion_tokens) == ("length", 30)
    assert 0 < msg.time_to_first_token_s < 60
    # n = 3: one message per completion, each with all its tokens.
    n3 = list(
        stack.stub.Generate(
            request(prompt, n=3, output_kind=pb.OUTPUT_KIND_FINAL_ONLY, **kw), timeout=60
        )
    )
    assert sorted(m.index for m in n3) == [0, 1, 2]
    assert all(len(m.token_ids) == 30 and m.finish_reason == "length" for m in n3)
    assert next(m for m in n3 if m.index == 0).token_ids == streamed.token_ids
    wait_all_free(stack)


def test_unknown_model(stack: Stack) -> None:
    req = request([5, 6], max_tokens=2)
    req.model = "no-such-model"
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(req))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_full_waiting_queue_is_resource_exhausted(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    small = start_stack(spawn, micro_llama, cp_args=("--max-num-seqs", "1", "--max-waiting", "2"))

    def run(i: int) -> str:
        try:
            generate(small.stub, [5 + i, 6, 7], max_tokens=200, ignore_eos=True, temperature=0.0)
            return "OK"
        except grpc.RpcError as exc:
            assert "waiting queue is full" in (exc.details() or "")
            return exc.code().name

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(run, range(8)))
    assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes


def test_min_tokens_suppresses_stop_tokens(stack: Stack) -> None:
    prompt = list(range(300, 320))
    first = generate(stack.stub, prompt, max_tokens=1, temperature=0.0).token_ids[0]
    out = generate(
        stack.stub,
        prompt,
        max_tokens=8,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[first],
        min_tokens=4,
    )
    assert len(out.token_ids) >= 4
    assert first not in out.token_ids[:3]


def test_reflection_and_health(stack: Stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    [resp] = list(refl.ServerReflectionInfo(iter([req])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"pagedserve.v1.ControlPlane", "grpc.health.v1.Health"} <= names
    health = health_pb2_grpc.HealthStub(stack.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.ControlPlane"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
