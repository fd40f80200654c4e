from __future__ import annotations

import pytest

from experts_store import ExpertArch, ExpertMLP, paper_parameter_count

pytestmark = pytest.mark.unit

WIDTHS = [(1, 1), (3, 2), (2, 5, 1), (3, 8, 8, 2), (4, 7, 6, 5, 8), (10, 1000, 1000, 1000, 1)]


@pytest.mark.parametrize("widths", WIDTHS)
def test_parameter_count_is_the_papers_formula_with_its_index_typo_corrected(
    widths: tuple[int, ...],
) -> None:
    # Eq. (2) uses A(j) in R^{d_{j+1} x d_j} and b(j), γ(j) of the layer's *output* width,
    # with no γ on the affine output layer: P = Σ_j d_{j+1}(d_j + 2) − d_{J+1}.
    corrected = sum(d_out * (d_in + 2) for d_in, d_out in zip(widths, widths[1:], strict=False))
    expected = corrected - widths[-1]
    arch = ExpertArch(widths=widths)
    assert arch.num_parameters() == expected
    if max(widths) <= 100:
        assert ExpertMLP(arch).num_parameters() == expected


@pytest.mark.parametrize("widths", WIDTHS)
def test_printed_formula_differs_from_the_module_only_by_its_boundary_terms(
    widths: tuple[int, ...],
) -> None:
    printed = paper_parameter_count(widths)
    assert ExpertArch(widths=widths).num_parameters() == printed - 2 * widths[0] + widths[-1]


def test_printed_formula_matches_when_output_is_twice_the_input() -> None:
    widths = (3, 9, 4, 6)
    assert paper_parameter_count(widths) == ExpertMLP(ExpertArch(widths=widths)).num_parameters()


def test_batchnorm_adds_affine_parameters_and_float_buffers() -> None:
    arch = ExpertArch(widths=(3, 8, 5, 2), batchnorm=True)
    expert = ExpertMLP(arch)
    assert expert.num_parameters() == arch.num_parameters()
    assert arch.num_parameters() == ExpertArch(widths=(3, 8, 5, 2)).num_parameters() + 2 * 13
    assert expert.nbytes() == arch.nbytes()


def test_json_round_trip() -> None:
    arch = ExpertArch(widths=(3, 8, 2), batchnorm=True, prelu_init=0.0)
    assert ExpertArch.from_json(arch.to_json()) == arch
    assert arch.input_dim == 3 and arch.output_dim == 2


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"widths": [3]}',
        '{"widths": [3, 0, 2]}',
        '{"widths": [3, true, 2]}',
        '{"widths": [3, 2], "batchnorm": "yes"}',
        '{"widths": [3, 2], "prelu_init": "x"}',
        '{"widths": [3, 2], "surprise": 1}',
    ],
)
def test_from_json_refuses_bad_arch(text: str) -> None:
    with pytest.raises(ValueError):
        ExpertArch.from_json(text)


def test_deepened_inserts_layers_of_last_hidden_width_before_output() -> None:
    assert ExpertArch(widths=(3, 8, 5, 2)).deepened(2).widths == (3, 8, 5, 5, 5, 2)
    assert ExpertArch(widths=(3, 2)).deepened(1).widths == (3, 3, 2)
