"""bf16 training with fp32 master weights (fastformer.training.mixed_precision) and the optimizer state that
checkpoints hold whatever the optimizer's implementation (fastformer.training.trainer.portable_optimizer_state), on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from fastformer import Transformer, TransformerConfig
from fastformer.training.mixed_precision import MasterWeights
from fastformer.training.trainer import load_optimizer_state, portable_optimizer_state
from tolerances import FP32


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig.tiny(vocab_size=50, dropout=0.0))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 50, (3, 7), generator=generator)
    tgt = torch.randint(3, 50, (3, 6), generator=generator)
    src[1, 5:] = 0  # right padding, so that lengths differ
    tgt[2, 4:] = 0
    tgt_in = torch.cat([torch.ones(3, 1, dtype=torch.long), tgt[:, :-1]], dim=1)
    return src, tgt_in, tgt


def _adam(parameters) -> torch.optim.Adam:
    return torch.optim.Adam(parameters, lr=1e-2, betas=(0.9, 0.98), eps=1e-9)


def test_bf16_copy_trains_and_fp32_masters_take_adams_update():
    """Three updates of two micro-batches: the master gradient is the fp32 sum of the bf16 copy's gradients, the
    masters' update is torch.optim.Adam's on those fp32 gradients (an independent fp32 copy stepped alongside), and
    the weights the bf16 model computes with are the masters rounded to bf16."""
    master_model = _model()
    weights = MasterWeights(master_model)
    optimizer = _adam(master_model.parameters())
    oracle = copy.deepcopy(master_model)
    oracle_optimizer = _adam(oracle.parameters())
    initial = copy.deepcopy(master_model.state_dict())
    assert all(parameter.dtype == torch.bfloat16 for parameter in weights.compute.parameters())
    for step in range(3):
        expected_grads = [torch.zeros_like(p, dtype=torch.float64) for p in master_model.parameters()]
        for micro in range(2):
            loss = weights.compute.loss(*_batch(10 * step + micro), reduction="sum")
            assert loss.dtype == torch.float32  # a summed loss is not rounded to bf16
            loss.backward()
            for total, parameter in zip(expected_grads, weights.compute.parameters()):
                assert parameter.grad.dtype == torch.bfloat16
                total += parameter.grad.double()
            weights.accumulate_gradients()
            assert all(not parameter.grad.any() for parameter in weights.compute.parameters())
        for total, parameter, twin in zip(expected_grads, master_model.parameters(), oracle.parameters()):
            torch.testing.assert_close(parameter.grad.double(), total, rtol=1e-6, atol=1e-7)
            twin.grad = parameter.grad.clone()
        optimizer.step()
        oracle_optimizer.step()
        weights.copy_to_compute()
        weights.zero_grad()
        assert not weights.flat_grad.any()
        for parameter, twin, compute in zip(master_model.parameters(), oracle.parameters(),
                                            weights.compute.parameters()):
            assert torch.equal(parameter, twin)
            assert torch.equal(compute, parameter.to(torch.bfloat16))
    moved = [name for name, tensor in master_model.state_dict().items() if not torch.equal(tensor, initial[name])]
    assert "encoder.layers.0.ffn.linear1.weight" in moved and "embed_tokens.weight" in moved
    # Updates below bf16's resolution still reach the masters.
    tiny_moves = [(p - initial[name]).abs() for name, p in master_model.named_parameters() if name in moved]
    assert any(((move > 0) & (move < initial_abs.abs() * 2 ** -9)).any()
               for move, initial_abs in zip(tiny_moves, [initial[n] for n in moved]))


def test_master_gradients_are_one_flat_buffer():
    model = _model()
    weights = MasterWeights(model)
    assert weights.flat_grad.numel() == sum(p.numel() for p in model.parameters())
    weights.flat_grad.fill_(2.0)
    assert all((parameter.grad == 2.0).all() for parameter in model.parameters())


def test_master_weights_need_an_fp32_model():
    with pytest.raises(ValueError, match="all fp32"):
        MasterWeights(_model().to(torch.bfloat16))


def test_optimizer_state_is_portable_across_implementations():
    """The eager Adam's state saved portably loads into a fused Adam with a tensor lr (as the captured step builds
    it), which keeps its own flags and a tensor lr, and continues with the same update; and back."""
    model = _model()
    eager = _adam(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    eager.step()
    saved = portable_optimizer_state(eager)
    assert saved["param_groups"][0]["lr"] == 1e-2 and not saved["param_groups"][0]["capturable"]
    twin = copy.deepcopy(model)
    lr = torch.tensor(0.5)
    fused = torch.optim.Adam(twin.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=True)
    load_optimizer_state(fused, saved)
    group = fused.param_groups[0]
    assert group["fused"] and isinstance(group["lr"], torch.Tensor) and float(group["lr"]) == pytest.approx(1e-2)
    for parameter, other in zip(model.parameters(), twin.parameters()):
        parameter.grad = torch.randn_like(parameter)
        other.grad = parameter.grad.clone()
    eager.step()
    fused.step()
    for parameter, other in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(other, parameter, **FP32)
    back = _adam(copy.deepcopy(model).parameters())
    load_optimizer_state(back, portable_optimizer_state(fused))
    assert back.param_groups[0]["lr"] == pytest.approx(1e-2) and not back.param_groups[0]["fused"]
    for index, state in eager.state_dict()["state"].items():
        torch.testing.assert_close(back.state_dict()["state"][index]["exp_avg"], state["exp_avg"], **FP32)
