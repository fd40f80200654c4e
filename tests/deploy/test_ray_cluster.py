"""deploy/ray-cluster.yaml (Ray's cluster launcher; no machines here to run it on): the server
its head starts can wait for the workers, and asks for what they offer."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml  # Ray's own dependency

from server._cli import build_parser
from server._serve_cli import settings_from_args

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray-cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    return loaded


def _serve_command(config: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The environment and arguments of the head's `momlp serve`."""
    (line,) = [c for c in config["head_start_ray_commands"] if re.search(r"momlp serve\b", c)
               and not c.startswith("pkill")]
    words = shlex.split(line.split(">")[0])
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    serve = words.index("serve")
    return env, words[serve + 1:]


def _group(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found is not None, (pattern, text)
    return found.group(1)


def test_the_head_server_waits_for_workers_the_launcher_sets_up_after_it(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, args = _serve_command(config)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = settings_from_args(build_parser().parse_args(["serve", *args]))
    # Workers install torch after the head is up: minutes, not the default 60 s.
    assert settings.actor_start_timeout_s >= 600
    # One actor per worker, each placed on a worker by the resource every worker offers.
    assert settings.actors == len(config["provider"]["worker_ips"])
    # Every command is a string (YAML turned an unquoted `--resources='{"a": 1}'` into a
    # mapping, which the launcher cannot run).
    assert all(isinstance(c, str) for key in ("head_start_ray_commands",
               "worker_start_ray_commands", "setup_commands") for c in config[key])
    (worker_start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    offered = json.loads(_group(r"--resources='([^']*)'", worker_start))
    assert offered.get(settings.actor_resource) == 1


def test_a_server_from_an_earlier_ray_up_is_stopped_before_the_new_one(
    config: dict[str, Any],
) -> None:
    commands = config["head_start_ray_commands"]
    stop = next(i for i, c in enumerate(commands) if c.startswith("pkill"))
    serve = next(i for i, c in enumerate(commands) if "momlp serve" in c and i != stop)
    assert stop < serve
    pattern = _group(r'pkill -INT -f "([^"]+)"', commands[stop])
    # It matches that server's command line, but not the shell line that runs pkill itself.
    _, args = _serve_command(config)
    assert re.search(pattern, "momlp serve " + " ".join(args))
    assert not re.search(pattern, commands[stop])
