"""all_finite: the one check that keeps NaN and inf out of every sync."""

import pytest
import torch

from p2ptrain.finite import all_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 4096, -1])
def test_one_bad_value_anywhere_is_caught(bad, where):
    tensor = torch.randn(10_000)
    tensor[where] = bad
    assert not all_finite(tensor)
    assert not all_finite(tensor.view(100, 100))


@pytest.mark.parametrize("tensor", [torch.randn(1000), torch.full((7,), 3.4e38), torch.zeros(0),
                                    torch.randn(8, dtype=torch.float16), torch.arange(5)])
def test_finite_tensors_pass(tensor):
    assert all_finite(tensor)


def test_same_answer_as_isfinite_on_random_tensors():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        tensor = torch.randn(int(torch.randint(1, 300, (1,), generator=generator)), generator=generator)
        mask = torch.rand(tensor.shape, generator=generator) < 0.01
        tensor[mask] = torch.tensor([float("nan"), float("inf"), -float("inf")])[
            torch.randint(0, 3, (int(mask.sum()),), generator=generator)]
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all())
