from dataclasses import replace

import pytest
import torch

from chatcli.model.gpt import ERAS, GPT, GPTConfig
from chatcli.training.muon import Muon, orthogonalize
from chatcli.training.train import PRESETS, make_optimizers, set_lr


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (24, 24)])
def test_orthogonalize_flattens_singular_values_and_keeps_singular_vectors(shape):
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=g))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=g))
    k = min(shape)
    # Singular values spread over two orders of magnitude.
    s = torch.logspace(0, -2, k)
    m = u[:, :k] @ torch.diag(s) @ v[:, :k].T
    x = orthogonalize(m)
    assert x.shape == m.shape
    sv = torch.linalg.svdvals(x)
    assert sv.min() > 0.5 and sv.max() < 1.3
    # Same singular vectors: in m's singular bases, x is diagonal with positive entries.
    core = u[:, :k].T @ x @ v[:, :k]
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 1e-3
    assert (torch.diagonal(core) > 0.5).all()


def test_orthogonalize_a_stack_equals_each_matrix_alone():
    m = torch.randn(3, 12, 20, generator=torch.Generator().manual_seed(1))
    batched = orthogonalize(m)
    for i in range(3):
        torch.testing.assert_close(batched[i], orthogonalize(m[i]), rtol=1e-5, atol=1e-6)


def test_muon_step_is_the_orthogonalized_nesterov_update():
    torch.manual_seed(2)
    tall = torch.nn.Parameter(torch.randn(32, 8))
    twins = [torch.nn.Parameter(torch.randn(8, 16)) for _ in range(2)]
    params = (tall, *twins)
    opt = Muon(params, lr=0.1, momentum=0.9)
    buffers = [torch.zeros_like(p) for p in params]
    for step in range(2):  # the second step has momentum to mix in
        before = [p.detach().clone() for p in params]
        grads = [torch.randn_like(p) for p in params]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        opt.step()
        for p, old, grad, buf in zip(params, before, grads, buffers, strict=True):
            buf.lerp_(grad, 0.1)
            nesterov = grad.lerp(buf, 0.9)
            expected = orthogonalize(nesterov) * max(1.0, p.size(0) / p.size(1)) ** 0.5
            torch.testing.assert_close(old - p.detach(), 0.1 * expected, rtol=1e-4, atol=1e-6)
            if step == 1:  # not the plain gradient's direction: the momentum counts
                assert not torch.allclose(orthogonalize(nesterov), orthogonalize(grad), atol=1e-3)


def test_muon_refuses_vectors():
    with pytest.raises(ValueError, match="only matrices"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


def test_make_optimizers_gives_every_parameter_one_optimizer():
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    model = GPT(config, ERAS["E"])
    muon_preset = replace(PRESETS["tiny"], optimizer="muon")
    adamw, muon = make_optimizers(model, muon_preset)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert not in_muon & in_adamw
    assert in_muon | in_adamw == {id(p) for p in model.parameters()}
    # The block matrices step with Muon; embeddings, lm_head and scalars with AdamW.
    assert id(model.transformer.h[0].attn.c_q.weight) in in_muon
    assert id(model.transformer.h[1].mlp.c_fc.weight) in in_muon
    for p in (model.transformer.wte.weight, model.lm_head.weight, model.resid_lambdas):
        assert id(p) in in_adamw
    assert id(model.smear_gate.weight) in in_adamw
    gates = [b.attn.ve_gate.weight for b in model.transformer.h if b.attn.ve_channels]
    assert gates and all(id(g) in in_muon for g in gates)
    assert muon.param_groups[0]["base_lr"] == muon_preset.matrix_lr

    (only,) = make_optimizers(model, PRESETS["tiny"])  # adamw: one optimizer for all
    assert sum(len(g["params"]) for g in only.param_groups) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="optimizer must be"):
        make_optimizers(model, replace(PRESETS["tiny"], optimizer="sgd"))


def test_set_lr_scales_every_group_by_its_own_base_rate():
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    preset = replace(PRESETS["tiny"], optimizer="muon", lr=0.01, matrix_lr=0.05)
    optimizers = make_optimizers(GPT(config, ERAS["E"]), preset)
    set_lr(optimizers, 0.5)
    rates = sorted(g["lr"] for opt in optimizers for g in opt.param_groups)
    # Scalars at 0.3x the AdamW rate, the other AdamW matrices, Muon's matrices.
    assert rates == pytest.approx([0.5 * 0.003, 0.5 * 0.01, 0.5 * 0.05])
