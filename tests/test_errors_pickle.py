"""Every package's errors survive pickling: a Ray task's error reaches the driver pickled,
and one that cannot be rebuilt arrives as Ray's "Failed to deserialize exception" instead of
its own type and message (a build's worker, another process)."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

import client
import experts_store
import router
import server
import trainer

pytestmark = pytest.mark.unit


def _errors() -> list[tuple[str, type[BaseException]]]:
    found = []
    for package in (client, experts_store, router, server, trainer):
        for name in package.__all__:
            obj = getattr(package, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                found.append((f"{package.__name__}.{name}", obj))
    return found


# Those whose required parameters the generic values below do not fit.
_KNOWN: dict[str, dict[str, Any]] = {
    "client.ExpertUnavailable": {"status_code": 503, "code": "expert_unavailable"},
    "server.UnknownStoreKind": {"known": ["momlp", "graph"]},
}


def _made(name: str, cls: type[BaseException]) -> BaseException:
    """An instance with a value for every required parameter, each telling which it is."""
    args: list[Any] = []
    kwargs: dict[str, Any] = dict(_KNOWN.get(name, {}))
    for parameter in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if parameter.default is not parameter.empty or parameter.name in kwargs or (
            parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        ):
            continue
        value: Any = 7 if parameter.annotation in ("int", "int | None") else parameter.name
        if "tuple" in str(parameter.annotation):
            value = (3, 4)
        elif "list" in str(parameter.annotation):
            value = [1, 2]
        elif "float" in str(parameter.annotation):
            value = 2.5
        if parameter.kind is parameter.KEYWORD_ONLY:
            kwargs[parameter.name] = value
        else:
            args.append(value)
    return cls(*args, **kwargs)


@pytest.mark.parametrize(("name", "cls"), _errors(), ids=[name for name, _ in _errors()])
def test_an_error_pickles_back_to_its_type_message_and_fields(
    name: str, cls: type[BaseException]
) -> None:
    error = _made(name, cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert vars(back) == vars(error)


def test_every_package_has_errors_here() -> None:
    packages = {name.split(".")[0] for name, _ in _errors()}
    assert packages == {"client", "experts_store", "router", "server", "trainer"}
    assert len(_errors()) >= 40
