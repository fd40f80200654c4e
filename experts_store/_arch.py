"""The architecture record of one expert: what a file header must carry to rebuild it."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ACTIVATIONS", "Activation", "ExpertArch", "paper_parameter_count"]

Activation = Literal["prelu", "relu", "gelu", "tanh", "sigmoid"]
# The hidden activation σ of an expert. "prelu" (one trainable γ per neuron) is the paper's
# and the default; the others have no parameters. Seed 002 (Thm 1) asks for *strongly
# identifiable* experts such as sigmoid, tanh or GELU ones for polynomial estimation rates.
ACTIVATIONS: tuple[Activation, ...] = ("prelu", "relu", "gelu", "tanh", "sigmoid")


@dataclass(frozen=True)
class ExpertArch:
    """Widths [d0, d1, ..., d_{J+1}] of a PReLU MLP (Definition 3.1 / eq. (2) of the paper).

    ``widths[0]`` is the input dimension, ``widths[-1]`` the output dimension, the ones in
    between the hidden widths (J = len(widths) - 2 hidden layers, possibly none).
    ``activation`` is the hidden layers' σ (see ACTIVATIONS); ``prelu_init`` only matters
    for "prelu". The JSON form names the activation only when it is not "prelu", so a PReLU
    expert's header (hence its file and content hash) is the same as before the field existed.
    """

    widths: tuple[int, ...]
    batchnorm: bool = False
    prelu_init: float = 0.25
    activation: Activation = "prelu"

    def __post_init__(self) -> None:
        widths = tuple(self.widths)
        if len(widths) < 2:
            raise ValueError(f"widths needs at least input and output dims, got {widths!r}")
        for width in widths:
            # bool is an int subclass; a width of True is a bug, not a 1.
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"every width must be a positive int, got {widths!r}")
        if not isinstance(self.batchnorm, bool):
            raise ValueError(f"batchnorm must be a bool, got {self.batchnorm!r}")
        if not math.isfinite(float(self.prelu_init)):
            raise ValueError(f"prelu_init must be finite, got {self.prelu_init!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"
            )
        object.__setattr__(self, "widths", widths)
        object.__setattr__(self, "prelu_init", float(self.prelu_init))

    @property
    def input_dim(self) -> int:
        return self.widths[0]

    @property
    def output_dim(self) -> int:
        return self.widths[-1]

    @property
    def hidden_widths(self) -> tuple[int, ...]:
        return self.widths[1:-1]

    @property
    def num_layers(self) -> int:
        """Number of affine layers, J + 1."""
        return len(self.widths) - 1

    def num_parameters(self) -> int:
        """Trainable parameters: affine weights and biases, one γ per hidden neuron (PReLU),
        and BatchNorm's affine weight and bias when enabled."""
        return self._counts()[0]

    def nbytes(self) -> int:
        """Bytes of parameters and buffers as float32 (+ BatchNorm's int64 batch counters)."""
        return self._counts()[1]

    def _counts(self) -> tuple[int, int]:
        # Kept on the instance beside the fields (not one of them: eq, hash and repr ignore
        # it): a store's rows share one arch object, so each row's ask is an attribute read,
        # not the hash of the fields that `_counts`' cache is keyed by (benchmarks/RESULTS.md,
        # fifty-seventh session).
        counts: tuple[int, int] | None = self.__dict__.get("_known_counts")
        if counts is None:
            counts = _counts(self)
            object.__setattr__(self, "_known_counts", counts)
        return counts

    def deepened(self, extra_layers: int) -> ExpertArch:
        """The arch with ``extra_layers`` more hidden layers of width d_J before the output."""
        if extra_layers < 0:
            raise ValueError(f"extra_layers must be >= 0, got {extra_layers}")
        width = self.widths[-2]
        widths = self.widths[:-1] + (width,) * extra_layers + self.widths[-1:]
        return ExpertArch(
            widths=widths, batchnorm=self.batchnorm, prelu_init=self.prelu_init,
            activation=self.activation,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "widths": list(self.widths),
            "batchnorm": self.batchnorm,
            "prelu_init": self.prelu_init,
        }
        if self.activation != "prelu":
            out["activation"] = self.activation
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ExpertArch:
        """Rebuild from :meth:`to_dict` output; ValueError on anything else."""
        if not isinstance(data, dict):
            raise ValueError(f"arch must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"widths", "batchnorm", "prelu_init", "activation"}
        if unknown:
            raise ValueError(f"unknown arch keys {sorted(unknown)}")
        widths = data.get("widths")
        if not isinstance(widths, list):
            raise ValueError("arch.widths must be a list of ints")
        prelu_init = data.get("prelu_init", 0.25)
        if isinstance(prelu_init, bool) or not isinstance(prelu_init, int | float):
            raise ValueError("arch.prelu_init must be a number")
        # Written before the field existed (or by a PReLU expert since): "prelu".
        activation = data.get("activation", "prelu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"arch.activation must be one of {', '.join(ACTIVATIONS)}")
        return cls(
            widths=tuple(widths),
            batchnorm=data.get("batchnorm", False),
            prelu_init=float(prelu_init),
            activation=activation,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> ExpertArch:
        try:
            data = json.loads(s)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arch is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def paper_parameter_count(widths: Sequence[int]) -> int:
    """P([d]) = sum_{j=0}^{J} d_j (d_{j+1} + 2), exactly as printed in the paper (Sec. 3.1).

    The printed formula gives b(j) and γ(j) the *input* width d_j of layer j and counts a γ
    for the affine output layer too; a network evaluating eq. (2) has biases and γ of the
    *output* width d_{j+1} and no γ on the output layer, so the two counts agree only when
    d_{J+1} = 2·d_0 (see :meth:`ExpertArch.num_parameters` for the count of the module).
    """
    return sum(d_in * (d_out + 2) for d_in, d_out in zip(widths, widths[1:], strict=False))


# Once per arch: opening a K=100,000 store asked each expert's counts twice, 1.8 s of 7.2 s
# under cProfile (benchmarks/RESULTS.md, fifty-second session). Frozen and hashable.
@functools.lru_cache(maxsize=4096)
def _counts(arch: ExpertArch) -> tuple[int, int]:
    widths = arch.widths
    affine = sum(d_in * d_out + d_out for d_in, d_out in zip(widths, widths[1:], strict=False))
    hidden = sum(arch.hidden_widths)
    gammas = hidden if arch.activation == "prelu" else 0
    params = affine + gammas + (2 * hidden if arch.batchnorm else 0)
    buffers = (2 * hidden * 4 + 8 * len(arch.hidden_widths)) if arch.batchnorm else 0
    return params, 4 * params + buffers
