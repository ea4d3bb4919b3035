"""Tests for chatcli.model.sampling: greedy, temperature, top-k, top-p and seeding, each through
the native sample_rows kernel (where it compiled) and through torch's ops."""

from __future__ import annotations

import math

import pytest
import torch

from chatcli.kernels.build import unavailable_reason
from chatcli.kernels.sample_rows import sample_rows
from chatcli.model import sampling
from chatcli.model.sampling import sample_next_token

_KERNEL = sample_rows()


@pytest.fixture(autouse=True, params=["native", "torch"])
def path(request, monkeypatch) -> str:
    """Every test twice: through the kernel, and with it unavailable (torch's ops)."""
    if request.param == "native" and _KERNEL is None:
        pytest.skip(f"no native kernel: {unavailable_reason('sample_rows')}")
    if request.param == "torch":
        monkeypatch.setattr(sampling, "sample_rows", lambda: None)
    return request.param


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits: torch.Tensor, n: int, seed: int = 0, **kwargs) -> torch.Tensor:
    """n samples from one (1, V) logits row, drawn as one batch of n identical rows."""
    return sample_next_token(logits.expand(n, -1), gen(seed), **kwargs)[:, 0]


PROBS = [0.5, 0.3, 0.1, 0.1]
LOGITS = torch.log(torch.tensor([PROBS]))  # softmax gives PROBS back at temperature 1


def test_greedy_takes_the_argmax_of_each_row_and_ignores_rng():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0], [-3.0, -2.0, -1.0, -4.0]])
    expected = [[1], [0], [2]]
    assert sample_next_token(logits, None, temperature=0.0).tolist() == expected
    assert sample_next_token(logits, gen(1), temperature=0.0).tolist() == expected
    assert sample_next_token(logits, gen(2), temperature=0.0, top_k=3).tolist() == expected


def test_output_is_one_long_id_per_row():
    ids = sample_next_token(torch.zeros(5, 11), gen())
    assert ids.shape == (5, 1)
    assert ids.dtype == torch.long


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    logits = torch.randn(16, 50, generator=gen(3))
    greedy = logits.argmax(dim=-1, keepdim=True)
    ids = sample_next_token(logits, gen(4), temperature=temperature, top_k=1)
    assert torch.equal(ids, greedy)


def test_top_k_only_draws_the_k_likeliest_ids():
    logits = torch.randn(1, 100, generator=gen(5))
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    samples = draws(logits, 5000, temperature=2.0, top_k=5)
    assert set(samples.tolist()) == top5  # every one of them, and nothing else


def test_top_k_at_least_the_vocabulary_is_no_restriction():
    logits = torch.zeros(1, 6)
    for top_k in (6, 1000, 0):
        assert set(draws(logits, 2000, top_k=top_k).tolist()) == set(range(6))


def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    assert set(draws(LOGITS, 5000, top_p=0.7).tolist()) == {0, 1}
    assert set(draws(LOGITS, 5000, top_p=0.5).tolist()) == {0}
    assert set(draws(LOGITS, 5000, top_p=0.85).tolist()) == {0, 1, 2}
    assert set(draws(LOGITS, 5000, top_p=1.0).tolist()) == {0, 1, 2, 3}


def test_top_p_finds_the_nucleus_when_ids_are_not_in_probability_order():
    order = [2, 0, 3, 1]  # the 0.5 token at id 2, the 0.3 token at id 0, ...
    logits = torch.empty(1, 4)
    logits[0, order] = LOGITS[0]
    assert set(draws(logits, 5000, top_p=0.7).tolist()) == {2, 0}


def test_top_p_renormalises_the_nucleus():
    samples = draws(LOGITS, 20_000, top_p=0.7)
    freq = (samples == 0).float().mean().item()
    assert freq == pytest.approx(0.5 / 0.8, abs=0.02)


def test_top_k_and_top_p_together_apply_top_p_inside_top_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # Inside top-2 the mass is 4/7, 3/7: top_p 0.5 keeps only the first.
    assert set(draws(logits, 3000, top_k=2, top_p=0.5).tolist()) == {0}
    assert set(draws(logits, 3000, top_k=3, top_p=0.9).tolist()) == {0, 1, 2}


def test_same_seed_gives_same_samples_and_different_seeds_differ():
    logits = torch.zeros(64, 1000)
    a = sample_next_token(logits, gen(7))
    b = sample_next_token(logits, gen(7))
    c = sample_next_token(logits, gen(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_frequencies_match_the_softmax_at_temperature_1():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    expected = torch.softmax(logits[0], dim=-1)
    samples = draws(logits, 20_000, seed=11)
    freq = torch.bincount(samples, minlength=4).float() / samples.numel()
    assert torch.allclose(freq, expected, atol=0.02)


def test_temperature_sharpens_and_flattens_the_distribution():
    logits = torch.tensor([[1.0, 0.0]])
    for temperature in (0.5, 2.0):
        p0 = 1 / (1 + math.exp(-1 / temperature))
        freq = (draws(logits, 20_000, seed=12, temperature=temperature) == 0).float().mean()
        assert freq.item() == pytest.approx(p0, abs=0.02)


def test_tokens_with_minus_inf_logits_are_never_drawn():
    logits = torch.full((1, 50), float("-inf"))
    logits[0, [0, 17, 49]] = torch.tensor([0.0, 1.0, -1.0])
    for kwargs in ({}, {"top_k": 10}, {"top_p": 0.99}, {"temperature": 50.0}):
        assert set(draws(logits, 5000, **kwargs).tolist()) <= {0, 17, 49}


@pytest.mark.parametrize("u", [0.0, 1.0 - 2**-24])
def test_the_extreme_uniform_draws_never_land_on_an_impossible_token(monkeypatch, u):
    # Pin the one uniform draw per row to the ends of [0, 1): a draw of 0 sits on the cdf of
    # the leading impossible ids, the largest draw on that of the trailing ones.
    def pinned(size, *, generator=None, device=None, dtype=None):
        return torch.full(size, u, device=device, dtype=dtype)

    monkeypatch.setattr(torch, "rand", pinned)
    inf = float("-inf")
    logits = torch.tensor([[inf, inf, 0.0, 1.0, inf], [inf, 0.0, inf, 0.0, inf]])
    ids = sample_next_token(logits, gen())[:, 0].tolist()
    assert ids == ([2, 1] if u == 0.0 else [3, 3])


def test_a_draw_rounded_up_to_the_total_falls_back_to_the_likeliest_token(monkeypatch):
    # A draw of exactly 1 (what rounding can make of u * total) passes every cdf value: the
    # row whose last id is possible keeps it; the row with an impossible tail falls back to
    # its likeliest id, while the other row's draw stands.
    def top(size, *, generator=None, device=None, dtype=None):
        return torch.ones(size, device=device, dtype=dtype)

    monkeypatch.setattr(torch, "rand", top)
    inf = float("-inf")
    logits = torch.tensor([[0.0, 2.0, 1.0, inf], [0.0, 0.0, 1.0, 0.5]])
    assert sample_next_token(logits, gen())[:, 0].tolist() == [1, 3]
    assert sample_next_token(logits[1:], gen())[:, 0].tolist() == [3]  # every row fine


def test_rows_are_sampled_independently():
    # Each row allows one different id: every row must draw its own.
    logits = torch.full((4, 8), float("-inf"))
    for row, token in enumerate([5, 0, 7, 3]):
        logits[row, token] = 0.0
    assert sample_next_token(logits, gen()).tolist() == [[5], [0], [7], [3]]
    # Identical uniform rows do not all draw the same id.
    ids = sample_next_token(torch.zeros(16, 1000), gen())
    assert len(set(ids[:, 0].tolist())) > 1


@pytest.mark.parametrize("temperature", [-0.1, -1.0])
def test_negative_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        sample_next_token(torch.zeros(1, 4), gen(), temperature=temperature)


def test_a_row_with_nan_logits_is_left_to_torchs_ops_with_the_same_draws(path, monkeypatch):
    # The kernel decides nothing for a batch with a NaN row; torch's ops decide it with the
    # draws the kernel took, so the generator moves on as on torch's path.
    logits = torch.randn(3, 100, generator=gen(1))
    logits[1, 5] = float("nan")
    g_native, g_plain = gen(5), gen(5)
    native = sample_next_token(logits, g_native, temperature=0.7)
    with monkeypatch.context() as m:
        m.setattr(sampling, "sample_rows", lambda: None)
        plain = sample_next_token(logits, g_plain, temperature=0.7)
    assert torch.equal(native, plain)
    assert torch.equal(g_native.get_state(), g_plain.get_state())


@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (None, 0.9), (50, None), (50, 0.9)])
def test_a_vanishing_temperature_is_greedy_not_nan(top_k, top_p):
    # logits / 1e-39 overflow to inf, and the softmax of those to NaN.
    logits = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0)) * 10
    for temperature in (1e-39, 1e-20, 5e-7):
        rng = torch.Generator().manual_seed(1)
        chosen = sample_next_token(logits, rng, temperature, top_k, top_p)
        assert torch.equal(chosen, logits.argmax(dim=-1, keepdim=True))
