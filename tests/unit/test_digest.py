"""The digest peers compare after every sync (records._digest_of, xxh3-128) tells apart global parameters that differ
by a single bit, in any tensor, at any place, of any dtype; and it is a pure function of the bits."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.diloco.records import _digest_of


def parameters() -> list:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(16, 12, generator=generator),  # a weight matrix
        torch.randn(12, generator=generator),  # a bias
        torch.zeros(7),  # all zeros: a flip makes a subnormal or a -0.0
        torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        torch.randn(9, generator=generator).to(torch.float16),
        torch.arange(5, dtype=torch.int64),  # a buffer of counts
        torch.randn(1, generator=generator),  # a lone scalar
    ]


def flip_bit(tensors: list, which: int, byte: int, bit: int) -> list:
    flipped = [t.clone() for t in tensors]
    raw = flipped[which].view(-1).view(torch.uint8)
    raw[byte] ^= 1 << bit
    return flipped


def test_the_digest_is_a_function_of_the_bits():
    tensors = parameters()
    assert _digest_of(tensors) == _digest_of([t.clone() for t in tensors])
    assert len(_digest_of(tensors)) == 32 and int(_digest_of(tensors), 16) >= 0
    # a non-contiguous tensor hashes as its values in order
    matrix = torch.randn(6, 4)
    assert _digest_of([matrix.t()]) == _digest_of([matrix.t().contiguous()])


def test_every_single_bit_flip_of_every_tensor_changes_the_digest():
    tensors = parameters()
    reference = _digest_of(tensors)
    seen = {reference}
    for which, tensor in enumerate(tensors):
        for byte in range(tensor.numel() * tensor.element_size()):
            for bit in range(8):
                digest = _digest_of(flip_bit(tensors, which, byte, bit))
                assert digest != reference, f"a flip of bit {bit} of byte {byte} of tensor #{which} went unseen"
                seen.add(digest)
    flips = sum(8 * t.numel() * t.element_size() for t in tensors)
    assert len(seen) == flips + 1  # and no two flips collide with each other either


def test_a_flip_deep_inside_a_large_tensor_changes_the_digest():
    """The 124m model's embedding is 50257 x 768 fp32: 154 MB hashed as one buffer."""
    big = torch.randn(4_000_000)
    reference = _digest_of([big])
    raw = big.view(torch.uint8)
    rng = random.Random(0)
    for byte in [0, 1, raw.numel() - 1, *(rng.randrange(raw.numel()) for _ in range(20))]:
        bit = 1 << rng.randrange(8)
        raw[byte] ^= bit
        assert _digest_of([big]) != reference, f"a flip in byte {byte} went unseen"
        raw[byte] ^= bit
        assert _digest_of([big]) == reference


@pytest.mark.parametrize("a, b", [(0.0, -0.0), (float("nan"), -float("nan"))])
def test_values_that_compare_equal_or_unordered_still_differ_in_bits(a, b):
    assert _digest_of([torch.tensor([a])]) != _digest_of([torch.tensor([b])])


def test_the_split_into_tensors_is_not_part_of_the_digest_but_the_order_is():
    """Peers compare digests of the same model, so the shapes are known; the order of the bytes is what matters."""
    x, y = torch.randn(4), torch.randn(4)
    assert _digest_of([x, y]) == _digest_of([torch.cat([x, y])])
    assert _digest_of([x, y]) != _digest_of([y, x])
