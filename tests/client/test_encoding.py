"""Request bodies: .npy written by hand must read back with numpy; the stdlib path agrees."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client import InputError
from client import _encoding as encoding

pytestmark = pytest.mark.unit


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    dim=st.integers(1, 70),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**16),
)
def test_npy_bytes_read_back_exactly(rows, dim, dtype, seed):
    array = np.random.default_rng(seed).normal(size=(rows, dim)).astype(dtype)
    encoded = encoding.encode_inputs(array, binary=True)
    assert encoded.npy is not None and encoded.rows is None
    # numpy pads the magic + header to a multiple of 64 bytes; a reader may rely on it.
    header_len = int.from_bytes(encoded.npy[8:10], "little")
    assert (10 + header_len) % 64 == 0
    back = np.load(io.BytesIO(encoded.npy), allow_pickle=False)
    assert back.dtype == dtype and back.shape == (rows, dim)
    np.testing.assert_array_equal(back, array)


def test_stdlib_path_writes_the_same_npy_as_numpy(monkeypatch):
    rows = [[0.5, -1.25, 3.0], [1e-3, 2.0, -7.5]]
    with_numpy = encoding.encode_inputs(rows, binary=True)
    monkeypatch.setattr(encoding, "numpy_or_none", lambda: None)
    without_numpy = encoding.encode_inputs(rows, binary=True)
    assert without_numpy.npy == with_numpy.npy
    back = np.load(io.BytesIO(without_numpy.npy), allow_pickle=False)
    np.testing.assert_array_equal(back, np.asarray(rows, dtype=np.float64))


def test_auto_binary_only_for_big_numpy_inputs():
    small = encoding.encode_inputs(np.ones((2, 3)), binary_min_values=7)
    big = encoding.encode_inputs(np.ones((3, 3)), binary_min_values=7)
    big_list = encoding.encode_inputs(np.ones((3, 3)).tolist(), binary_min_values=7)
    assert small.rows == [[1.0] * 3] * 2 and small.npy is None
    assert big.npy is not None and big.rows is None
    assert big_list.rows is not None and big_list.npy is None


def test_tolist_objects_without_numpy(monkeypatch):
    class Tensorish:
        def tolist(self):
            return [[1, 2], [3, 4]]

    monkeypatch.setattr(encoding, "numpy_or_none", lambda: None)
    assert encoding.encode_inputs(Tensorish()).rows == [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(InputError):
        encoding.encode_inputs([[1.0, float("inf")]])


def test_a_tensor_that_requires_grad_is_sent_as_its_values():
    # np.asarray refuses such a tensor (RuntimeError); the values are what the server needs.
    torch = pytest.importorskip("torch")
    tensor = torch.tensor([[0.5, -1.25], [3.0, 4.0]], requires_grad=True)
    for binary in (False, True):
        encoded = encoding.encode_inputs(tensor, binary=binary)
        plain = encoding.encode_inputs(tensor.detach().numpy(), binary=binary)
        assert (encoded.rows, encoded.npy) == (plain.rows, plain.npy)
