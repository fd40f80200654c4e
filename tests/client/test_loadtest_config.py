"""LoadTestConfig refuses a bad setting with the client's own error, naming the setting."""

from __future__ import annotations

from typing import Any

import pytest

from client import LoadTestConfig, LoadTestConfigError, MomlpError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("settings", "setting", "message"),
    [
        ({"requests": 0}, "requests", "requests must be >= 1"),
        ({"requests": None, "duration_s": None}, "requests", "give requests or duration_s"),
        ({"duration_s": 0.0}, "duration_s", "duration_s must be > 0"),
        ({"concurrency": 0}, "concurrency", "concurrency must be >= 1"),
        ({"batch": 0}, "batch", "batch must be >= 1"),
        ({"top_k": 0}, "top_k", "top_k must be >= 1"),
        ({"rate": 0.0}, "rate", "rate must be > 0"),
        ({"timeout_s": 0.0}, "timeout_s", "timeout_s must be > 0"),
        ({"max_retries": -1}, "max_retries", "max_retries must be >= 0"),
        ({"conditions": 0}, "conditions", "conditions must be in [1, 1000000]"),
        ({"distribution": "pareto"}, "distribution", "distribution must be uniform"),
        ({"condition_distribution": "pareto"}, "condition_distribution",
         "condition_distribution must be uniform or zipf:S (S >= 0), got 'pareto'"),
        ({"gate": {"tau": 1.0}}, "gate", "unknown gate fields ['tau']"),
    ],
)
def test_a_bad_setting_is_a_load_test_config_error_naming_it(
    settings: dict[str, Any], setting: str, message: str
) -> None:
    with pytest.raises(LoadTestConfigError) as caught:
        LoadTestConfig(**settings)
    error = caught.value
    assert str(error).startswith(message)
    assert error.setting == setting
    assert error.value == settings.get(setting)
    # One tree for the package, and callers that catch the bare ValueError still do.
    assert isinstance(error, MomlpError) and isinstance(error, ValueError)
