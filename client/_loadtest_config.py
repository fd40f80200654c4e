"""`LoadTestConfig`: one load test's settings, each checked once when the config is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ._conditions import MAX_CONDITIONS
from ._exceptions import InputError, LoadTestConfigError
from ._options import check_gate
from ._workload import Distribution

__all__ = ["LoadTestConfig"]


@dataclass(frozen=True)
class LoadTestConfig:
    """One load test. Stops after `requests` or `duration_s`, whichever comes first (one is
    required, except with `eval_data`: then both None is one pass over its rows); `rate`
    (requests/s, Poisson arrivals) switches from closed to open loop.

    A setting out of range raises `LoadTestConfigError` (a `ValueError`) naming it.
    """

    url: str = "http://127.0.0.1:8000"
    requests: int | None = 1000
    duration_s: float | None = None
    concurrency: int = 8
    rate: float | None = None
    batch: int = 1
    top_k: int = 1
    mode: Literal["tree", "exact"] | None = None
    distribution: str = "uniform"
    seed: int = 0
    report_dir: Path | None = None
    api_key: str | None = None
    timeout_s: float = 30.0
    max_retries: int = 0
    binary: bool | None = None
    save_requests: bool = False
    plots: bool = True
    candidates_per_expert: int = 8
    route_chunk_rows: int = 1024
    # Sent with every request: temperature, min_weight, top_p, beam, score (server caps apply).
    gate: dict[str, Any] | None = None
    # An .npz with `x` and `y`: send these rows and report accuracy (replaces the workload).
    eval_data: Path | None = None
    # Kind hyper: each row's condition drawn from `conditions` random ones under
    # `condition_distribution` (uniform or zipf:S); replaces the expert workload.
    conditions: int | None = None
    condition_distribution: str = "uniform"
    # The verdict of the run (`LoadTestReport.failure_check`): it fails when more than this
    # fraction of its requests failed. None: no verdict (some failures are the point of a run
    # pushed past the server's capacity, whose 429s are its designed answer).
    max_failed_fraction: float | None = None

    def __post_init__(self) -> None:
        try:
            Distribution.parse(self.distribution)
        except ValueError as exc:
            raise LoadTestConfigError(
                str(exc), setting="distribution", value=self.distribution
            ) from exc
        try:
            law: Distribution | None = Distribution.parse(self.condition_distribution)
        except ValueError:
            law = None
        if law is None or law.kind == "cluster":
            # Refused here, before the run connects (the workload refused cluster only then):
            # cluster is a law over the experts' prototypes, conditions have none.
            raise LoadTestConfigError(
                "condition_distribution must be uniform or zipf:S (S >= 0), got "
                f"{self.condition_distribution!r}", setting="condition_distribution",
                value=self.condition_distribution,
            )
        if self.conditions is not None and not 1 <= self.conditions <= MAX_CONDITIONS:
            raise _out_of_range("conditions", self.conditions, f"in [1, {MAX_CONDITIONS}]")
        if self.requests is None and self.duration_s is None and self.eval_data is None:
            # With eval_data and neither, the run is one pass over its rows.
            raise LoadTestConfigError("give requests or duration_s", setting="requests",
                                      value=None)
        if self.requests is not None and self.requests < 1:
            raise _out_of_range("requests", self.requests, ">= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise _out_of_range("duration_s", self.duration_s, "> 0")
        for setting in ("concurrency", "batch", "top_k"):
            if getattr(self, setting) < 1:
                raise _out_of_range(setting, getattr(self, setting), ">= 1")
        if self.rate is not None and self.rate <= 0:
            raise _out_of_range("rate", self.rate, "> 0")
        if not self.timeout_s > 0:
            raise _out_of_range("timeout_s", self.timeout_s, "> 0")
        if self.max_retries < 0:
            raise _out_of_range("max_retries", self.max_retries, ">= 0")
        limit = self.max_failed_fraction
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 <= limit <= 1
        ):  # NaN fails the range test too
            raise LoadTestConfigError(
                f"max_failed_fraction must be a number in [0, 1], got {limit!r}",
                setting="max_failed_fraction", value=limit,
            )
        # Unknown gate fields fail here (exit 2), not on every request of the run.
        try:
            check_gate(self.gate)
        except InputError as exc:
            raise LoadTestConfigError(exc.message, setting="gate", value=self.gate) from exc

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["report_dir"] = str(self.report_dir) if self.report_dir is not None else None
        data["eval_data"] = str(self.eval_data) if self.eval_data is not None else None
        data["api_key"] = "***" if self.api_key else None
        return data


def _out_of_range(setting: str, value: Any, bound: str) -> LoadTestConfigError:
    return LoadTestConfigError(f"{setting} must be {bound}", setting=setting, value=value)
