"""The files and the runtime of a hyper store: f, its conditions table and θ_I as an expert.

    save_hypernetwork(layers, path)            f's (weight, bias) per layer → safetensors
    f = FrozenHyperNetwork.load(path, expected_sha256=...)
    expert = f.expert(condition, spec)          θ_I = f(I) as a FrozenExpert (γ = 0, zero biases)
    key = condition_key(f_sha256, condition)    sha256 of f's hash and I's float32 bytes

The two cache keys (`GeneratorRef` names f, `GeneratedRef` θ_I, by `condition_key`) are
`_hyper_refs`', re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_save

from experts_store._exceptions import (
    ExpertChecksumError,
    ExpertFileMissing,
    ExpertFormatError,
    ExpertLoadError,
    StoreWriteError,
)
from experts_store._format import dtype_name, file_problem, read_expert_bytes, save_expert
from experts_store._frozen import FrozenExpert
from experts_store._hyper import HyperSpec
from experts_store._hyper_refs import GeneratedRef, GeneratorRef, condition_bytes, condition_key
from experts_store._model import ExpertMLP

__all__ = [
    "FrozenHyperNetwork",
    "GeneratedRef",
    "GeneratorRef",
    "check_hypernetwork_file",
    "condition_bytes",
    "condition_key",
    "load_conditions",
    "own_file_problem",
    "save_conditions",
    "save_hypernetwork",
    "theta_expert",
    "theta_file_bytes",
    "theta_module",
    "verify_hyper_files",
]

HYPER_FORMAT = "momlp-hypernetwork"
CONDITIONS_FORMAT = "momlp-conditions"
# Named in errors about f: it is no expert of the store.
GENERATOR_ID = -1


def save_hypernetwork(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], path: Path) -> str:
    """Write f's layers (weight [out, in], bias [out]) as safetensors; returns the sha256."""
    tensors: dict[str, torch.Tensor] = {}
    widths = [int(layers[0][0].shape[1])]
    for i, (weight, bias) in enumerate(layers):
        tensors[f"layers.{i}.weight"] = weight.detach().to("cpu", torch.float32).contiguous()
        tensors[f"layers.{i}.bias"] = bias.detach().to("cpu", torch.float32).contiguous()
        widths.append(int(weight.shape[0]))
    for name, tensor in tensors.items():
        _finite(path, name, tensor)
    meta = {"format": HYPER_FORMAT, "widths": json.dumps(widths)}
    return _write(path, safetensors_save(tensors, metadata=meta))


def save_conditions(conditions: torch.Tensor, ids: Sequence[str], path: Path) -> str:
    """Write a named-conditions table [C, m2] (ids in the metadata); returns the sha256."""
    if conditions.dim() != 2 or conditions.shape[0] != len(ids):
        raise ValueError(f"{len(ids)} ids for a table of shape {list(conditions.shape)}")
    if len(set(ids)) != len(ids):
        raise ValueError("condition ids must be distinct")
    table = conditions.detach().to("cpu", torch.float32).contiguous()
    _finite(path, "the conditions table", table)
    meta = {"format": CONDITIONS_FORMAT, "ids": json.dumps(list(ids))}
    return _write(path, safetensors_save({"conditions": table}, metadata=meta))


def _write(path: Path, data: bytes) -> str:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def _read(
    path: Path, expected_sha256: str | None, expert_id: int, expected_bytes: int | None = None
) -> bytes:
    # `read_expert_bytes`: a FIFO at the path is refused, not read for ever, and a file of
    # another size than the manifest's is refused unread.
    sha256 = hashlib.sha256()
    # f lies at its store's root (the manifest admits no other name): an actor loads it long
    # after the store's open checked it, so the file read is judged where it is read.
    data = read_expert_bytes(
        path, expert_id=expert_id, digests=(sha256,), expected_bytes=expected_bytes,
        store_root=str(path.parent),
    ).numpy().tobytes()
    if expected_sha256 is not None:
        actual = sha256.hexdigest()
        if actual != expected_sha256:
            raise ExpertChecksumError(expert_id=expert_id, expected=expected_sha256, actual=actual)
    return data


def _bad(path: Path, reason: str) -> ExpertFormatError:
    return ExpertFormatError(expert_id=GENERATOR_ID, reason=f"{path.name}: {reason}")


def _tensors(data: bytes, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    # safetensors parses its own format (no pickle); reading from the verified bytes means
    # what was checked is what is used.
    from safetensors.torch import load as safetensors_load

    try:
        tensors = safetensors_load(data)
        size = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    except Exception as exc:  # a malformed file is a format error, whatever raised it
        raise _bad(path, str(exc)) from exc
    return tensors, {str(k): str(v) for k, v in meta.items()}


def _json_list(path: Path, meta: dict[str, str], key: str) -> list[object]:
    try:
        value = json.loads(meta.get(key, "[]"))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        raise _bad(path, f"its {key!r} metadata is not JSON") from None
    if not isinstance(value, list):
        raise _bad(path, f"its {key!r} metadata is not a JSON list")
    return value


def _widths(path: Path, meta: dict[str, str]) -> list[int]:
    """f's `widths` metadata: two or more positive JSON integers (not 5.0, not true)."""
    listed = _json_list(path, meta, "widths")
    widths = [w for w in listed if type(w) is int and w >= 1]
    if len(widths) < 2 or len(widths) != len(listed):
        raise _bad(path, f"widths {listed} are not two or more positive ints")
    return widths


def _finite(path: Path, name: str, tensor: torch.Tensor) -> None:
    """StoreWriteError before a write: a server would refuse the file (or serve NaN)."""
    if not bool(torch.isfinite(tensor).all()):
        raise StoreWriteError(
            path=path, reason=f"{name} holds NaN or infinite values (did its training diverge?)"
        )


def load_conditions(
    path: Path,
    expected_sha256: str | None = None,
    *,
    shape: tuple[int, int] | None = None,
    expected_bytes: int | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """A named-conditions table and its ids, verified against `expected_sha256`,
    `expected_bytes` and `shape` (the manifest's [count, m2]) when given: float32, finite,
    one distinct id per row."""
    data = _read(path, expected_sha256, GENERATOR_ID, expected_bytes)
    tensors, meta = _tensors(data, path)
    if meta.get("format") != CONDITIONS_FORMAT or "conditions" not in tensors:
        raise _bad(path, "not a table")
    table = tensors["conditions"]
    if table.dtype != torch.float32 or table.dim() != 2:
        raise _bad(path, f"a {dtype_name(table.dtype)} table of shape {list(table.shape)}, "
                   "not F32 [C, m2]")
    if shape is not None and tuple(table.shape) != shape:
        raise _bad(path, f"a table of shape {list(table.shape)}, the manifest's is {list(shape)}")
    if not bool(torch.isfinite(table).all()):
        raise _bad(path, "the table holds NaN or infinite values")
    ids = _json_list(path, meta, "ids")
    if len(ids) != table.shape[0]:
        raise _bad(path, "ids and rows differ")
    if not all(isinstance(i, str) for i in ids) or len(set(ids)) != len(ids):
        raise _bad(path, "the ids are not distinct strings")
    return table, [str(i) for i in ids]


def check_hypernetwork_file(
    path: Path, widths: Sequence[int], *, expected_bytes: int | None = None
) -> None:
    """ExpertFormatError unless the file at `path` is f of `widths` (and `expected_bytes`),
    the manifest's: its size and header only, names, dtypes and shapes; the arrays stay
    unread (`FrozenHyperNetwork.load` reads and checks them where f is pinned, as the same
    parse of `widths`). A server checks this before it goes live."""
    problem = file_problem(path)  # safe_open would block on a FIFO
    if problem == "no such file":
        raise ExpertFileMissing(expert_id=GENERATOR_ID, path=path)
    if problem is not None:
        raise _bad(path, problem)
    size = path.stat().st_size
    if expected_bytes is not None and size != expected_bytes:
        raise _bad(path, f"the file holds {size} bytes, the manifest says {expected_bytes}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            slices = {name: f.get_slice(name) for name in f.keys()}
            found = {name: (t.get_dtype(), tuple(t.get_shape())) for name, t in slices.items()}
    except (SafetensorError, OSError) as exc:
        raise _bad(path, f"not a readable safetensors file ({exc})") from exc
    if meta.get("format") != HYPER_FORMAT:
        raise _bad(path, "not f")
    if _widths(path, meta) != list(widths):
        raise _bad(path, f"its widths metadata is not the manifest's {list(widths)}")
    problem = _layers_problem(found, widths)
    if problem is not None:
        raise _bad(path, problem)


def _layers_problem(
    found: dict[str, tuple[str, tuple[int, ...]]], widths: Sequence[int]
) -> str | None:
    """How f's tensors (name → safetensors dtype, shape) differ from those of a ReLU MLP of
    `widths` (float32 weight [out, in] and bias [out] per layer), or None."""
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i in range(len(widths) - 1):
        expected[f"layers.{i}.weight"] = ("F32", (widths[i + 1], widths[i]))
        expected[f"layers.{i}.bias"] = ("F32", (widths[i + 1],))
    for name, (dtype, shape) in expected.items():
        if name not in found:
            return f"no tensor {name!r} (f of widths {list(widths)})"
        if found[name] != (dtype, shape):
            got_dtype, got_shape = found[name]
            return (f"{name} is {got_dtype} {list(got_shape)}, f of widths {list(widths)} needs "
                    f"{dtype} {list(shape)}")
    extra = sorted(set(found) - set(expected))
    return f"unexpected tensors {extra[:4]} (f of widths {list(widths)})" if extra else None


class FrozenHyperNetwork:
    """f for inference: ReLU MLP layers as plain tensors, op for op nn.Sequential's forward
    (F.linear, ReLU), so θ_I is bit-identical to the trained module's `generate`."""

    __slots__ = ("widths", "_layers")

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._layers = layers
        self.widths = [int(layers[0][0].shape[1])] + [int(w.shape[0]) for w, _ in layers]

    @classmethod
    def load(
        cls,
        path: Path | str,
        device: str | torch.device = "cpu",
        *,
        expected_sha256: str | None = None,
        expected_bytes: int | None = None,
    ) -> FrozenHyperNetwork:
        path = Path(path)
        data = _read(path, expected_sha256, GENERATOR_ID, expected_bytes)
        tensors, meta = _tensors(data, path)
        if meta.get("format") != HYPER_FORMAT:
            raise _bad(path, "not f")
        widths = _widths(path, meta)
        found = {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}
        problem = _layers_problem(found, widths)
        if problem is not None:
            raise _bad(path, problem)
        if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
            # θ = f(I) would be NaN for every condition.
            raise _bad(path, "its weights hold NaN or infinite values")
        count = len(widths) - 1
        return cls([
            (tensors[f"layers.{i}.weight"].to(device), tensors[f"layers.{i}.bias"].to(device))
            for i in range(count)
        ])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self._layers for t in layer)

    @property
    def device(self) -> torch.device:
        return self._layers[0][0].device

    def flat(self, conditions: torch.Tensor) -> torch.Tensor:
        """f(I) for conditions [C, m2] → [C, P] (no gradients)."""
        h = conditions.to(self.device, torch.float32)
        last = len(self._layers) - 1
        with torch.inference_mode():
            for i, (weight, bias) in enumerate(self._layers):
                h = F.linear(h, weight, bias)
                if i < last:
                    h = torch.relu(h)
        return h

    def expert(self, condition: torch.Tensor, spec: HyperSpec) -> FrozenExpert:
        """θ_I = f(I) for one condition [m2], as the expert the actors cache and serve.

        One condition per forward, always: the same I gives the same bits whichever other
        conditions are generated around it.
        """
        flat = self.flat(condition.reshape(1, -1))[0]
        return theta_expert(flat, spec)


def _theta_state(flat: torch.Tensor, spec: HyperSpec) -> dict[str, torch.Tensor]:
    widths = spec.primary.widths
    values = {s.name: flat[s.offset : s.offset + s.numel].reshape(s.shape) for s in spec.layout}
    state: dict[str, torch.Tensor] = {}
    for j in range(len(widths) - 1):
        weight = values[f"layers.{j}.weight"]
        state[f"linears.{j}.weight"] = weight.clone().contiguous()
        bias = values.get(f"layers.{j}.bias")
        state[f"linears.{j}.bias"] = (
            bias.clone().contiguous() if bias is not None else weight.new_zeros(widths[j + 1])
        )
        if j < len(widths) - 2:
            # PReLU with γ = 0 is exactly ReLU: max(0, h) + 0·min(0, h).
            state[f"activations.{j}.weight"] = weight.new_zeros(widths[j + 1])
    return state


def theta_expert(flat: torch.Tensor, spec: HyperSpec) -> FrozenExpert:
    """A flat θ [P] (f's output) as a store expert: `spec.expert_arch`, γ = 0, zero biases
    where g has none."""
    if flat.dim() != 1 or flat.shape[0] != spec.theta_size:
        raise ExpertFormatError(
            expert_id=GENERATOR_ID,
            reason=f"θ of shape {list(flat.shape)}, need [{spec.theta_size}]",
        )
    return FrozenExpert(spec.expert_arch, _theta_state(flat, spec))


def theta_module(flat: torch.Tensor, spec: HyperSpec) -> ExpertMLP:
    """The same θ as an `ExpertMLP` (what `save_expert` writes)."""
    module = ExpertMLP(spec.expert_arch, device="meta")
    module.load_state_dict(_theta_state(flat.to("cpu"), spec), assign=True)
    return module.eval()


def theta_file_bytes(flat: torch.Tensor, spec: HyperSpec, tmp_dir: Path) -> bytes:
    """θ as the bytes of a store expert file (exactly `save_expert`'s format)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    path = tmp_dir / f".theta-{os.getpid()}-{id(flat)}.safetensors"
    try:
        save_expert(theta_module(flat, spec), path)
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


def verify_hyper_files(root: Path, spec: HyperSpec) -> list[str]:
    """Problems with a hyper store's own files (f, the conditions table): presence, sha256,
    format and shapes against the manifest block; an empty list when all hold."""
    problems: list[str] = []
    f = spec.hypernetwork
    try:
        net = FrozenHyperNetwork.load(
            root / f.file, expected_sha256=f.sha256, expected_bytes=f.bytes
        )
        if net.widths != f.widths:
            problems.append(f"hypernetwork {f.file}: widths {net.widths}, manifest {f.widths}")
    except ExpertLoadError as exc:
        problems.append(own_file_problem(f"hypernetwork {f.file}", exc))
    table = spec.conditions
    if table is not None:
        try:
            load_conditions(
                root / table.file, table.sha256, shape=(table.count, spec.condition_dim),
                expected_bytes=table.bytes,
            )
        except ExpertLoadError as exc:
            problems.append(own_file_problem(f"conditions {table.file}", exc))
    return problems


def own_file_problem(label: str, exc: Exception) -> str:
    """`label: <what went wrong>` for an error reading a hyper store's own file (f, the
    conditions table), without the "expert -1: bad expert file: " that its loader's stand-in
    id put in front: these files are not experts, and `label` ends with the file's name."""
    if isinstance(exc, ExpertFormatError):
        return f"{label}: {exc.reason.removeprefix(label.rsplit(' ', 1)[-1] + ': ')}"
    message = str(exc)
    return f"{label}: {message.removeprefix(f'expert {GENERATOR_ID}: ')}"
