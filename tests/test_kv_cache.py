"""Tests for chatcli.model.kv_cache: layout, position bookkeeping, batch-1 expansion and rewind."""

from __future__ import annotations

import pytest
import torch

from chatcli.model.kv_cache import KVCache


def cache(batch_size: int = 2, seq_len: int = 10, **kwargs) -> KVCache:
    shape = {"num_heads": 3, "head_dim": 4, "num_layers": 2} | kwargs
    return KVCache(batch_size=batch_size, seq_len=seq_len, **shape)


def fill(c: KVCache, n: int) -> None:
    """Write n positions of recognisable values, as a model would, and advance."""
    L, B, _, H, D = c.k_cache.shape
    values = torch.arange(L * B * n * H * D, dtype=c.k_cache.dtype).view(L, B, n, H, D)
    c.k_cache[:, :, c.pos : c.pos + n] = values + 1
    c.v_cache[:, :, c.pos : c.pos + n] = -(values + 1)
    c.advance(n)


def test_k_and_v_are_laid_out_layers_batch_time_heads_dim():
    c = cache(batch_size=2, seq_len=10, num_heads=3, head_dim=4, num_layers=5)
    assert c.k_cache.shape == (5, 2, 10, 3, 4)
    assert c.v_cache.shape == (5, 2, 10, 3, 4)
    assert c.cache_seqlens.tolist() == [0, 0]
    k, v = c.get_layer_cache(3)
    assert k.shape == v.shape == (2, 10, 3, 4)


def test_layer_cache_is_a_view_the_model_writes_in_place():
    c = cache()
    k, v = c.get_layer_cache(1)
    k[0, 0] = 7.0
    v[1, 2] = -3.0
    assert torch.all(c.k_cache[1, 0, 0] == 7.0)
    assert torch.all(c.v_cache[1, 1, 2] == -3.0)
    assert torch.all(c.k_cache[0] == 0.0)


def test_cache_takes_the_requested_dtype():
    assert cache(dtype=torch.bfloat16).k_cache.dtype == torch.bfloat16
    assert cache().v_cache.dtype == torch.float32


def test_advance_moves_position_and_seqlens_and_reset_empties():
    c = cache(batch_size=3)
    assert c.get_pos() == 0
    c.advance(4)
    c.advance(1)
    assert c.get_pos() == 5
    assert c.cache_seqlens.tolist() == [5, 5, 5]
    c.prev_token = torch.tensor([1, 2, 3])
    c.reset()
    assert c.get_pos() == 0
    assert c.cache_seqlens.tolist() == [0, 0, 0]
    assert c.prev_token is None


def test_advance_up_to_capacity_is_fine_and_past_it_raises():
    c = cache(seq_len=6)
    c.advance(6)
    assert c.get_pos() == 6
    with pytest.raises(ValueError, match="overflow: 7 > 6"):
        c.advance(1)
    assert c.get_pos() == 6  # a refused advance leaves the position alone


def test_prefill_copies_a_batch_1_cache_into_every_row():
    small = cache(batch_size=1, seq_len=5)
    fill(small, 5)
    small.prev_token = torch.tensor([42])
    big = cache(batch_size=4, seq_len=12)
    big.prefill(small)
    assert big.get_pos() == 5
    assert big.cache_seqlens.tolist() == [5, 5, 5, 5]
    for row in range(4):
        assert torch.equal(big.k_cache[:, row, :5], small.k_cache[:, 0, :5])
        assert torch.equal(big.v_cache[:, row, :5], small.v_cache[:, 0, :5])
    assert torch.all(big.k_cache[:, :, 5:] == 0)
    assert big.prev_token.tolist() == [42, 42, 42, 42]


def test_prefill_copies_a_same_batch_cache_row_for_row():
    src = cache(batch_size=2, seq_len=4)
    fill(src, 3)
    dst = cache(batch_size=2, seq_len=8)
    dst.prefill(src)
    assert dst.get_pos() == 3
    assert torch.equal(dst.k_cache[:, :, :3], src.k_cache[:, :, :3])
    assert torch.equal(dst.v_cache[:, :, :3], src.v_cache[:, :, :3])
    assert not torch.equal(dst.k_cache[:, 0, :3], dst.k_cache[:, 1, :3])


def test_prefill_refuses_a_batch_it_cannot_expand():
    src = cache(batch_size=2)
    fill(src, 1)
    with pytest.raises(ValueError, match="batch of 2 to 3"):
        cache(batch_size=3).prefill(src)


def test_prefill_refuses_a_cache_of_another_model_shape():
    with pytest.raises(ValueError, match="different model shapes"):
        cache(batch_size=2, num_heads=1).prefill(cache(batch_size=1))


def test_prefill_refuses_more_positions_than_fit():
    src = cache(batch_size=1, seq_len=8)
    fill(src, 8)
    with pytest.raises(ValueError, match="8 positions does not fit in 5"):
        cache(batch_size=2, seq_len=5).prefill(src)


def test_rewind_forgets_positions_and_sets_the_previous_token():
    c = cache(batch_size=2)
    fill(c, 6)
    c.rewind(4, prev_token=9)
    assert c.get_pos() == 4
    assert c.cache_seqlens.tolist() == [4, 4]
    assert c.prev_token.tolist() == [9, 9]
    c.advance(6)  # the whole capacity is usable again
    assert c.get_pos() == 10


def test_rewind_to_zero_clears_the_previous_token():
    c = cache()
    fill(c, 3)
    c.rewind(0, prev_token=5)
    assert c.get_pos() == 0
    assert c.prev_token is None


@pytest.mark.parametrize("pos", [-1, 4])
def test_rewind_outside_what_the_cache_holds_raises(pos):
    c = cache()
    fill(c, 3)
    with pytest.raises(ValueError, match=f"cannot rewind to {pos}"):
        c.rewind(pos, prev_token=None)
    assert c.get_pos() == 3


def test_rewind_past_zero_needs_the_previous_token():
    # Without it era E's smear would silently mix nothing into the next token.
    c = cache()
    fill(c, 3)
    with pytest.raises(ValueError, match="needs the token at 1"):
        c.rewind(2, prev_token=None)
    assert c.get_pos() == 3


def test_prefill_from_a_cache_without_a_previous_token_clears_it():
    dst = cache(batch_size=2)
    fill(dst, 2)
    dst.prev_token = torch.tensor([5, 6])
    src = cache(batch_size=1)
    fill(src, 1)
    dst.prefill(src)
    assert dst.get_pos() == 1
    assert dst.prev_token is None
