"""The one settings object of a momlp server, built once by the CLI and passed down."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from experts_store import CachePolicy

__all__ = ["ByteSize", "Settings", "byte_size"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip


# No machine has 8 EiB of memory; past it a size is a typo, and torch's int64 sizes overflow.
_MAX_BYTES = 2**63 - 1
# The least body limit a server starts with. Below 1 KiB a /v2 request of one row of a few
# dozen values (its JSON tensor header alone is ~80 bytes) or a /v1 JSON row of ~40 values
# does not fit: such a limit is a unit left off (`--max-body-bytes 64` for 64MiB), and
# `MOMLP_MAX_BODY_BYTES=1` started a server that refused every body.
_MIN_BODY_BYTES = 1024


def byte_size(text: str) -> int:
    """`268435456`, `256MiB`, `1.5GB` -> bytes (ValueError naming the text otherwise)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 268435456, 256MiB)")
    if len(match.group(1)) > 40:
        # Fraction of a longer digit string is slow, and its size is over the cap anyway.
        raise ValueError(f"byte size {text.strip()!r} is above 8 EiB")
    # Exact: float() turned 400 digits into inf (OverflowError, a traceback) and rounded
    # sizes above 2**53 to another number of bytes.
    size = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    if size > _MAX_BYTES:
        raise ValueError(f"byte size {text.strip()!r} is above 8 EiB")
    return size


def _bytes_or_text(value: Any) -> Any:
    # A MOMLP_*_BYTES variable takes what the CLI options take ("512MiB"); numbers pass.
    return byte_size(value) if isinstance(value, str) else value


ByteSize = Annotated[int, BeforeValidator(_bytes_or_text)]


class Settings(BaseSettings):
    """Every knob of `momlp serve`; environment variables use the `MOMLP_` prefix.

    Nothing reads the environment at import time: a `Settings()` call does, once, in the CLI
    (or in a test, which passes values explicitly).
    """

    # inf and NaN are refused: MOMLP_WATCH_INTERVAL_S=inf passed gt=0 and never polled.
    model_config = SettingsConfigDict(env_prefix="MOMLP_", extra="ignore", allow_inf_nan=False)

    store: Path = Field(default=Path("./store"), description="store directory to serve")
    model_name: str | None = Field(
        default=None,
        description="the model's name under /v2 (Open Inference Protocol); default: the store"
        " directory's name",
    )
    host: str = Field(default="127.0.0.1", description="address to bind")
    port: int = Field(default=8000, ge=0, le=65535, description="port to bind (0 picks a free one)")
    api_key: SecretStr | None = Field(
        default=None, description="bearer key required on every endpoint but /healthz"
    )

    ray_address: str | None = Field(
        default=None, description="Ray cluster address; None starts an embedded local Ray"
    )
    # A supervisor or a Kubernetes pod often starts the server before the head it joins
    # accepts connections: serve refused at once with "connection refused".
    ray_connect_wait_s: float = Field(
        default=30.0,
        ge=0.0,
        description="with ray_address HOST:PORT, wait up to this long for the head to accept a"
        " connection before giving up (0: give up at once)",
    )
    ray_num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs for an embedded Ray (None lets Ray decide)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto picks CUDA when the Ray cluster has a GPU, else CPU"
    )
    actors: int = Field(
        default=1, ge=1, description="actors on CPU; on CUDA one actor per GPU of the cluster,"
        " or with --ray-address this many GPU actors when given and more (a head whose GPU"
        " workers join later)"
    )
    cache_bytes: ByteSize = Field(
        default=256 * 1024 * 1024, ge=1, description="expert cache budget per actor, bytes"
    )
    host_cache_bytes: ByteSize = Field(
        default=0,
        ge=0,
        description="CUDA actors: pinned host memory per actor that keeps loaded experts'"
        " files, so a device miss on one of them is a copy, not a file read (0: off)",
    )
    cache_policy: CachePolicy = Field(
        default="tinylfu",
        description="tinylfu: LRU victims, but a newcomer must be more popular than the victim"
        " to displace it (keeps hot experts on skewed traffic); lru: plain recency",
    )
    actor_max_restarts: int = Field(
        default=3, ge=0, description="restarts Ray grants each actor (a hung one's kill uses one)"
    )
    # Ray counts an actor's restarts over its whole life: without a new actor once they were
    # spent, a server running for weeks lost its actors one by one, for good.
    actor_replace_interval_s: float = Field(
        default=60.0,
        gt=0.0,
        description="an actor out of restarts is replaced by a new one, at most once within "
        "this (an actor that dies as it starts then costs one start per interval)",
    )
    actor_start_timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        description="the actors must all be placed and up within this, and so must a new "
        "actor in the place of one out of restarts",
    )
    # A process that hangs without dying (a read stuck on a network filesystem, a deadlock in
    # a native library, SIGSTOP) held its batches' in-flight slots for good, until the server
    # answered nothing while /readyz said ready. Above an actor's own wait for cache room
    # (30 s) plus a slow load, so that only a call that is not coming back passes it.
    actor_call_timeout_s: float = Field(
        default=120.0,
        gt=0.0,
        description="an actor's answer to a call must come within this of its sending; past "
        "it the actor is taken for hung: its process is killed for Ray to restart, and that "
        "call's rows are retried on another actor (on the restarted one when it is alone) "
        "while a request still waits for them",
    )
    # An actor that took no batches died unseen until a request found it dead (ready said
    # /readyz meanwhile; one out of restarts was replaced only then).
    actor_health_check_s: float = Field(
        default=10.0,
        ge=0.0,
        description="every live actor is asked about itself this often; one whose answer is "
        "an error of Ray's, or comes from another process than the last probe's (a restart "
        "no call saw), is taken for dead (restarted or replaced, counted as died) without "
        "waiting for a request to find it; a probe that times out is sent again at once "
        "(the first one's late answer still counts), "
        "and an actor that holds a call for over 1 s is probed then, between the rounds "
        "(0: off)",
    )
    # A stopped or frozen process was found only by a call's deadline (120 s), and meanwhile
    # every batch with rows on it held its in-flight slot: the whole server stalled.
    actor_unresponsive_s: float = Field(
        default=10.0,
        ge=0.0,
        description="an actor that answers no health check (each on a thread of its own, "
        "beside its calls) and no call for this long is taken for hung: its process is "
        "killed for Ray to restart and its calls' rows are retried on the other actors "
        "(0: only MOMLP_ACTOR_CALL_TIMEOUT_S finds it; needs MOMLP_ACTOR_HEALTH_CHECK_S); "
        "from its first probe unanswered, its calls' rows run on the others, and it takes "
        "none until it answers",
    )
    actor_resource: str | None = Field(
        default=None,
        description="Ray resource each actor takes one of (e.g. momlp_worker): one actor a node",
    )

    max_batch_wait_ms: float = Field(default=2.0, ge=0.0, description="batch window")
    # Under a closed-loop burst, requests join a window a few tenths of a ms apart here; a
    # gap of 0.3 ms split bursts (more batches, more CPU per row), 0.6 did not, and let
    # light load skip most of the window (benchmarks/RESULTS.md, "Ninth session: the batch
    # gap").
    batch_gap_ms: float = Field(
        default=0.6,
        ge=0.0,
        description="close a batch window early once no request has joined it for this long;"
        " 0 waits out the whole window",
    )
    max_batch_rows: int = Field(default=4096, ge=1, description="rows merged into one batch")
    # A thread hop costs more than routing a few rows: benchmarks/RESULTS.md, "routing on the
    # event loop".
    inline_route_ms: float = Field(
        default=2.0,
        ge=0.0,
        le=50.0,
        description="route a batch or a /v1/route request on the event loop when its routing"
        " is estimated to take at most this much CPU; larger ones go to a thread (0: always a"
        " thread)",
    )
    max_inflight_batches: int = Field(
        default=2, ge=1, le=64, description="batches of one store version routed or running at once"
    )
    max_queue_rows: int = Field(
        default=65536,
        ge=1,
        description="rows admitted and not yet computed (queued, or in a running batch also "
        "after their caller left) above which new requests get 429",
    )
    spill_queue_rows: int = Field(
        default=1024, ge=1, description="queued rows on a home actor before a hot expert spills"
    )
    # Unset: on for CUDA actors, where a load crosses PCIe while another expert computes; off
    # for CPU ones, where a load from the page cache is CPU work the run would do anyway and
    # the extra routing and actor calls cost more than they hide (benchmarks/RESULTS.md,
    # "prefetch on CPU").
    prefetch: bool | None = Field(
        default=None,
        description="warm home actors as soon as routing knows; unset: on for CUDA, off for CPU",
    )
    # Unset: on for CUDA actors, where the next group's copy over PCIe overlaps this group's
    # compute; off for CPU ones, where the hand-off to a helper thread costs more than it hides
    # (benchmarks/RESULTS.md, "look-ahead on CPU").
    lookahead: bool | None = Field(
        default=None,
        description="actors lease the next group's expert on a helper thread while one "
        "computes; unset: on for CUDA, off for CPU",
    )
    # A Ray actor call costs ~1 ms of CPU and ~1.5 ms of latency on a 2-core machine; the
    # socket carries the same call for ~0.1-0.4 ms (benchmarks/RESULTS.md, "Ninth session
    # ...: each batch reaches an actor over a Unix socket").
    actor_channel: Literal["socket", "ray"] = Field(
        default="socket",
        description="how the server sends each batch to an actor on its own node: socket (a"
        " Unix socket into the Ray actor) or ray (a Ray actor call); prefetch, info and actors"
        " on other nodes always use Ray calls",
    )

    max_rows: int = Field(default=8192, ge=1, description="rows per request (413 above)")
    max_body_bytes: ByteSize = Field(
        default=32 * 1024 * 1024,
        description=f"request body size (413 above; at least {_MIN_BODY_BYTES}, 1 KiB)",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0.0, description="a request body must arrive within this (408 after)"
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        description="a request's headers must all arrive within this of its connection opening"
        " or of the connection's previous response, else the connection is closed",
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="HTTP connections open at once; one opened beyond is closed before it is"
        " read (lowered to half the process's file-descriptor limit where that is smaller)",
    )
    request_timeout_s: float = Field(default=60.0, gt=0.0)
    drain_s: float = Field(
        default=0.0,
        ge=0.0,
        le=3600.0,
        description="after SIGTERM/SIGINT, keep answering for this long while the readiness"
        " probes say 503 draining, so that a load balancer stops sending first; a second"
        " signal stops at once",
    )
    default_top_k: int = Field(
        default=1, ge=1,
        description="top_k of a request that names none (at most max_top_k; a store of fewer"
        " experts serves its K)",
    )
    default_mode: Literal["tree", "exact"] | None = Field(
        default=None, description="None uses the mode the store was trained for"
    )
    max_top_k: int = Field(
        default=8, ge=1, description="cap on a request's top_k (422 naming it above)"
    )
    max_beam: int = Field(
        default=8, ge=1, description="cap on each width of a request's beam gate"
    )
    max_temperature_ratio: float = Field(
        default=1000.0,
        ge=1.0,
        description="a request's gate temperature must lie within the store's τ times or"
        " divided by this",
    )
    max_conditions: int = Field(
        default=256, ge=1,
        description="kind hyper: distinct conditions per request (422 naming it above); each"
        " costs one generation and |θ| of cache on a miss",
    )
    gc_freeze: bool = Field(
        default=True,
        description="once started, exempt the objects then alive from the cyclic GC (its full"
        " collections of that heap otherwise pause the server ~150 ms every few seconds)",
    )
    access_log: bool = Field(
        default=True,
        description="log one line per HTTP request (uvicorn's access log); off saves its"
        " formatting and write on every request, for deployments that log at a proxy",
    )
    watch_store: bool = Field(default=True, description="reload when manifest.json changes")
    watch_interval_s: float = Field(default=2.0, gt=0.0)

    @field_validator("store", "host", "model_name", "actor_resource", mode="before")
    @classmethod
    def _not_blank(cls, value: Any) -> Any:
        # An empty MOMLP_HOST (a template's unset variable) bound every interface, an empty
        # MOMLP_STORE served the working directory, and an empty MOMLP_ACTOR_RESOURCE asked
        # Ray for a resource no node has. A deliberate choice is spelled out: 0.0.0.0, ".".
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"{value!r} is blank")
        return value

    @field_validator("max_body_bytes")
    @classmethod
    def _body_fits_a_request(cls, value: int) -> int:
        if value < _MIN_BODY_BYTES:
            raise ValueError(
                f"{value} bytes is below the least body limit, {_MIN_BODY_BYTES} (1 KiB): no"
                " request of a row of a few dozen values fits (a unit left off? e.g. 64MiB)"
            )
        return value

    @field_validator("model_name")
    @classmethod
    def _one_path_segment(cls, value: str | None) -> str | None:
        # The name is one segment of /v2/models/{name}/...: with a "/" no URL reaches it, and
        # every /v2 request got 404.
        if value is not None and "/" in value:
            raise ValueError(f"{value!r} contains '/' (it is one segment of /v2/models/NAME)")
        return value

    @model_validator(mode="after")
    def _default_within_cap(self) -> Settings:
        # Else every request that leaves top_k out would get a 422 for a value it never sent.
        if self.default_top_k > self.max_top_k:
            raise ValueError(
                f"default_top_k (MOMLP_DEFAULT_TOP_K) {self.default_top_k} exceeds max_top_k "
                f"(MOMLP_MAX_TOP_K) {self.max_top_k}"
            )
        return self
