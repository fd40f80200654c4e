"""The actor channel without Ray: frames round-trip exactly, corrupt frames are refused, and a
`Channel` against a real `ChannelServer` on a Unix socket answers overlapping calls in any
order, reports `run`'s failures, and fails every pending call when the actor goes away."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from experts_store import ExpertRef, GeneratedRef, GeneratorRef
from server.pool import (
    ActorReply,
    CacheCounts,
    Channel,
    ChannelCallFailed,
    ChannelClosed,
    ChannelServer,
    GroupOutcome,
    WireError,
)
from server.pool._wire import (
    PREFIX,
    RunDecoder,
    RunEncoder,
    RunPayload,
    decode_reply,
    encode_failure,
    encode_reply,
    parse_prefix,
)

GENERATOR = GeneratorRef("f" * 64, "/store/hyper.safetensors", 4096, -1, "xxh3:0123", 4200)
REFS: list[ExpertRef] = [
    ExpertRef("a" * 64, "/store/experts/e0.safetensors", 1000, 0, "xxh3:abcd", 1064),
    ExpertRef("b" * 64, "/store/experts/e1.safetensors", 2000, 1, None),
    GeneratedRef(
        "c" * 64,
        GENERATOR.path,
        3000,
        7,
        None,
        generator=GENERATOR,
        condition=np.array([0.5, -1.25], "<f4").tobytes(),
        spec_json='{"widths": [2, 3]}',
    ),
]


def split(frame: bytes) -> tuple[bytes, bytes]:
    header_len, body_len = parse_prefix(frame[: PREFIX.size])
    header = frame[PREFIX.size : PREFIX.size + header_len]
    body = frame[PREFIX.size + header_len :]
    assert len(body) == body_len
    return header, body


def payload(seed: int = 0) -> RunPayload:
    rng = np.random.default_rng(seed)
    return [(ref, rng.standard_normal((i + 1, 5)).astype(np.float32)) for i, ref in enumerate(REFS)]


def reply_for(groups: RunPayload, actor: str = "actor-0") -> ActorReply:
    """What a fake actor answers: each group's rows summed per row, and group 1 failed."""
    outcomes = [
        GroupOutcome(
            expert_id=ref.expert_id,
            outputs=None if i == 1 else rows.sum(axis=1, keepdims=True),
            hit=i == 0,
            load_ms=0.25 * i,
            compute_ms=1.5,
            expert_bytes=ref.nbytes,
            activation_bytes=rows.nbytes,
            error="bad checksum" if i == 1 else None,
            error_kind="load" if i == 1 else None,
            key=ref.sha256 if isinstance(ref, GeneratedRef) else None,
            generator_bytes=GENERATOR.nbytes if isinstance(ref, GeneratedRef) else 0,
        )
        for i, (ref, rows) in enumerate(groups)
    ]
    return ActorReply(
        actor=actor,
        results=outcomes,
        device_bytes=6000,
        resident={ref.sha256: ref.nbytes for ref, _ in groups},
        counts=CacheCounts(evictions=3, loads=5, load_bytes=2**40 + 7),
        process="5f0e6a",
    )


def encode_run(call: int, groups: RunPayload) -> bytes:
    return RunEncoder().encode(call, groups)


def decode_run(header: bytes, body: bytes) -> tuple[int, RunPayload]:
    return RunDecoder().decode(header, body)


def assert_same_payload(got: RunPayload, sent: RunPayload) -> None:
    for (ref, rows), (got_ref, got_rows) in zip(sent, got, strict=True):
        assert type(got_ref) is type(ref)
        assert got_ref.__dict__ == ref.__dict__  # every field, not only the hash
        assert got_rows.dtype == np.float32
        np.testing.assert_array_equal(got_rows, rows)


def test_a_run_frame_carries_every_kind_of_ref_and_the_rows_bit_for_bit() -> None:
    sent = payload()
    call, received = decode_run(*split(encode_run(41, sent)))
    assert call == 41
    assert_same_payload(received, sent)


def test_a_ref_travels_once_per_connection_and_its_number_after() -> None:
    encoder, decoder = RunEncoder(), RunDecoder()
    first, second = payload(0), payload(1)
    header, body = split(encoder.encode(1, first))
    assert_same_payload(decoder.decode(header, body)[1], first)
    again, body2 = split(encoder.encode(2, second))
    assert b"/store/experts/e0" in header and b"/store/experts/e0" not in again
    call, received = decoder.decode(again, body2)
    assert call == 2
    assert_same_payload(received, second)
    # Equal-looking refs of two store versions are two refs, each with its own path.
    moved = ExpertRef("a" * 64, "/store2/experts/e0.safetensors", 1000, 0, "xxh3:abcd")
    [(got, _rows)] = decoder.decode(*split(encoder.encode(3, [(moved, second[0][1])])))[1]
    assert got.path == moved.path
    # A connection that never saw the definition cannot make sense of the number.
    with pytest.raises(WireError, match="unknown ref"):
        RunDecoder().decode(again, body2)


def test_past_its_limit_the_encoder_starts_both_tables_over() -> None:
    encoder, decoder = RunEncoder(max_refs=4), RunDecoder()
    for call in range(6):
        sent = payload(call)  # the same three refs...
        if call % 2:
            sent = [(ExpertRef(f"{call}" * 64, f"/s/{call}", 8, call), rows) for _, rows in sent]
        received = decoder.decode(*split(encoder.encode(call, sent)))[1]
        assert_same_payload(received, sent)
    assert len(encoder._handles) <= 4 and len(decoder._refs) <= 4


def test_after_forget_both_tables_start_over_and_drop_the_old_versions_refs() -> None:
    encoder, decoder = RunEncoder(), RunDecoder()
    rows = np.arange(5, dtype=np.float32).reshape(1, 5)
    old = ExpertRef("a" * 64, "/store/v1/e0.safetensors", 1000, 0, "xxh3:abcd")
    decoder.decode(*split(encoder.encode(1, [(old, rows)])))
    held = weakref.ref(old)
    encoder.forget()  # a new store version went live
    new = ExpertRef("a" * 64, "/store/v2/e0.safetensors", 1000, 0, "xxh3:abcd")
    header, body = split(encoder.encode(2, [(new, rows)]))
    assert_same_payload(decoder.decode(header, body)[1], [(new, rows)])
    del old
    gc.collect()
    assert held() is None  # the encoder kept the old version's ref until now
    assert len(encoder._handles) == 1 and len(decoder._refs) == 1
    # Once over: the next frame uses the new definition and resets nothing.
    again, body = split(encoder.encode(3, [(new, rows)]))
    assert b"reset" not in again and b"/store/v2" not in again
    assert_same_payload(decoder.decode(again, body)[1], [(new, rows)])


def test_a_ref_that_cannot_be_framed_defines_nothing() -> None:
    class Odd(ExpertRef):
        pass

    encoder, decoder = RunEncoder(), RunDecoder()
    rows = np.zeros((1, 5), np.float32)
    with pytest.raises(WireError, match="cannot be framed"):
        encoder.encode(1, [(REFS[0], rows), (Odd("d" * 64, "/x", 1, 9), rows)])
    # REFS[0] was not taken as defined: the next frame still carries it.
    received = decoder.decode(*split(encoder.encode(2, [(REFS[0], rows)])))[1]
    assert_same_payload(received, [(REFS[0], rows)])


def test_a_reply_frame_carries_outcomes_errors_and_residency() -> None:
    reply = reply_for(payload())
    call, received = decode_reply(*split(encode_reply(9, reply)))
    assert call == 9 and isinstance(received, ActorReply)
    assert (
        received.actor, received.device_bytes, received.resident, received.counts,
        received.process,
    ) == (reply.actor, reply.device_bytes, reply.resident, reply.counts, reply.process)
    for sent, got in zip(reply.results, received.results, strict=True):
        if sent.outputs is None:
            assert got.outputs is None
        else:
            assert got.outputs is not None
            np.testing.assert_array_equal(got.outputs, sent.outputs)
        assert {**got.__dict__, "outputs": None} == {**sent.__dict__, "outputs": None}
    assert decode_reply(*split(encode_failure(3, "ValueError: boom"))) == (3, "ValueError: boom")


Damage = Callable[[bytes, bytes], tuple[bytes, bytes]]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda h, b: (h, b[:-4]), "shorter"),
        (lambda h, b: (h, b + bytes(4)), "longer"),
        (lambda h, b: (h.replace(b'"kind":"expert"', b'"kind":"pickle"', 1), b), "ref kind"),
        (lambda h, b: (h.replace(b'"nbytes":1000', b'"nbytes":"1k"', 1), b), "not an integer"),
        (lambda h, b: (h.replace(b'"call":5', b'"call":5.5', 1), b), "not an integer"),
        (lambda h, b: (h.replace(b"[0,1,5]", b"[0,1,-5]", 1), b), "negative"),
        (lambda h, b: (h.replace(b"[0,1,5]", b"[7,1,5]", 1), b), "unknown ref"),
        (lambda h, b: (h.replace(b"[0,1,5]", b"[0,1]", 1), b), "bad run header"),
        (lambda h, b: (h.replace(b'"groups"', b'"grupos"', 1), b), "bad run header"),
    ],
)
def test_a_damaged_run_frame_is_refused_not_misread(damage: Damage, message: str) -> None:
    header, body = damage(*split(encode_run(5, payload())))
    with pytest.raises(WireError, match=message):
        decode_run(header, body)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda h, b: (h.replace(b"[0,true,", b"[0,true,1,", 1), b), "fields"),
        (lambda h, b: (h.replace(b"[0,true,", b'["0",true,', 1), b), "not an integer"),
        (lambda h, b: (h.replace(b'["<f4",1,1]', b'["<f2",1,1]', 1), b), "unknown dtype"),
        (lambda h, b: (h, b[:-1]), "shorter"),
    ],
)
def test_a_damaged_reply_frame_is_refused_not_misread(damage: Damage, message: str) -> None:
    header, body = damage(*split(encode_reply(9, reply_for(payload()))))
    with pytest.raises(WireError, match=message):
        decode_reply(header, body)


def test_a_frame_without_the_magic_or_over_the_size_limits_is_refused() -> None:
    frame = encode_run(5, payload())
    with pytest.raises(WireError, match="magic"):
        parse_prefix(b"XXXX" + frame[4 : PREFIX.size])
    with pytest.raises(WireError, match="too large"):
        parse_prefix(PREFIX.pack(frame[:4], 1 << 30, 0))


def test_a_header_that_is_not_json_is_refused() -> None:
    with pytest.raises(WireError, match="JSON"):
        decode_reply(b"\x80\x04not json", b"")
    with pytest.raises(WireError, match="object"):
        decode_reply(b"[1, 2]", b"")


def socket_path(tmp_path: Path) -> Path:
    # tmp_path can be longer than a socket path may be.
    return Path("/tmp") / f"momlp-test-{tmp_path.name[-40:]}.sock"


async def test_overlapping_calls_get_their_own_answers(tmp_path: Path) -> None:
    server = ChannelServer(socket_path(tmp_path), reply_for)
    channel = await Channel.connect(server.path)
    try:
        sent = [payload(seed) for seed in range(20)]
        replies = await asyncio.gather(*(channel.run(p) for p in sent))
        for groups, reply in zip(sent, replies, strict=True):
            expected = reply_for(groups)
            for got, want in zip(reply.results, expected.results, strict=True):
                if want.outputs is not None:
                    np.testing.assert_array_equal(got.outputs, want.outputs)
    finally:
        await channel.close()
        server.close()
    assert not server.path.exists()


async def test_a_run_that_raises_fails_only_its_call(tmp_path: Path) -> None:
    def run(groups: RunPayload) -> ActorReply:
        if groups[0][1].shape[0] == 1 and groups[0][1][0, 0] > 100:
            raise RuntimeError("device lost")
        return reply_for(groups)

    server = ChannelServer(socket_path(tmp_path), run)
    channel = await Channel.connect(server.path)
    try:
        bad = [(REFS[0], np.full((1, 5), 1000.0, np.float32))]
        with pytest.raises(ChannelCallFailed, match="RuntimeError: device lost"):
            await channel.run(bad)
        reply = await channel.run(payload())  # the connection serves on
        assert reply.actor == "actor-0" and not channel.closed
    finally:
        await channel.close()
        server.close()


async def test_every_pending_call_fails_when_the_actor_goes_away(tmp_path: Path) -> None:
    """A fake actor that reads calls and never answers, then drops the connection."""
    path = socket_path(tmp_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    arrived = threading.Event()

    def actor() -> None:
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        arrived.set()
        conn.close()

    thread = threading.Thread(target=actor)
    thread.start()
    channel = await Channel.connect(path)
    try:
        calls = [asyncio.create_task(channel.run(payload(seed))) for seed in range(3)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert arrived.is_set()
        assert all(isinstance(r, ChannelClosed) for r in results)
        assert channel.closed
        with pytest.raises(ChannelClosed):
            await channel.run(payload())
    finally:
        await channel.close()
        thread.join()
        listener.close()
        path.unlink()


def test_a_socket_path_too_long_for_the_kernel_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="longer than"):
        ChannelServer(tmp_path / ("x" * 120), reply_for)
