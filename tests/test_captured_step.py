"""The captured (CUDA-graph) training step against the eager one: GPU only (`gpu`-marked, skipped elsewhere)."""

from __future__ import annotations

import copy

import pytest
import torch

import fastformer
from fastformer import Transformer, TransformerConfig
from fastformer.data import BucketBatchSampler, LengthFilter, TokenizedCorpus, find_split, read_parallel, \
    train_tokenizer
from fastformer.training.mixed_precision import MasterWeights
from fastformer.training.trainer import _LossModule
from tolerances import assert_close_lowp

pytestmark = pytest.mark.gpu
STEPS = 50


@pytest.fixture(scope="module")
def batches():
    """STEPS bucketed batches of 4000 pairs of the bundled corpus, over epochs (a few shapes, each seen several times)."""
    files = find_split(None, "train")
    pairs = read_parallel(files.src, files.tgt)[:4000]
    tokenizer = train_tokenizer((sentence for pair in pairs for sentence in pair), vocab_size=500)
    corpus = TokenizedCorpus.encode(tokenizer, pairs, LengthFilter())
    sampler = BucketBatchSampler(corpus.src_lengths, corpus.tgt_lengths, 2048, seed=0, max_buckets=4)
    planned = [b for epoch in range(4) for b in sampler.batches(epoch)][:STEPS]  # an epoch holds ~40
    assert len(planned) == STEPS
    return [corpus.batch(b.indices, 500, b.shape) for b in planned]


def _config(dropout: float = 0.0) -> TransformerConfig:
    return TransformerConfig(vocab_size=500, d_model=256, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                             d_ff=1024, dropout=dropout, attention_dropout=dropout, max_positions=256)


def _train(batches, precision: str, captured: bool, backend: str = "auto") -> tuple[list[float], Transformer]:
    """Trains a fresh model one update per batch -> (per-token losses, the fp32 model)."""
    from fastformer.training.captured_step import CapturedStep
    torch.manual_seed(0)
    model = Transformer(_config()).cuda()
    master = MasterWeights(model) if precision == "bf16-master" else None
    loss_module = _LossModule(model if master is None else master.compute, label_smoothing=0.1)
    lr = torch.tensor(1e-3, device="cuda") if captured else 1e-3
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=captured or None,
                                 capturable=captured)
    step = CapturedStep(master, loss_module, optimizer, torch.device("cuda")) if captured else None
    losses = []
    with fastformer.backend(backend):
        for batch in batches:
            if step is not None:
                step.micro_step(batch)
                step.update(1.0 / batch.target_tokens)
                losses.append(step.take_loss_sum().item() / batch.target_tokens)
                continue
            loss = loss_module(*(tensor.cuda() for tensor in batch[:5]))
            loss.backward()
            if master is not None:
                master.accumulate_gradients()
            for parameter in model.parameters():
                parameter.grad.mul_(1.0 / batch.target_tokens)
            optimizer.step()
            if master is not None:
                master.copy_to_compute()
                master.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item() / batch.target_tokens)
    return losses, model


def test_captured_losses_track_eager_for_50_steps(batches):
    """The bf16 2x rule on the loss curve: the captured step's error against fp32 eager training is at most twice
    that of eager bf16-master training with plain PyTorch ops."""
    fp32, _ = _train(batches, "auto", captured=False, backend="reference")
    eager_bf16, _ = _train(batches, "bf16-master", captured=False, backend="reference")
    captured, _ = _train(batches, "bf16-master", captured=True)
    assert len(captured) == STEPS and fp32[-1] < fp32[0]
    assert_close_lowp(torch.tensor(captured), torch.tensor(eager_bf16), torch.tensor(fp32), "losses")


def test_one_captured_step_has_the_eager_gradients(batches):
    """After the warm-up runs the shape is captured; the replayed step's master gradients match the eager step's on
    the same weights and batch (the 2x rule against fp32 gradients)."""
    from fastformer.training.captured_step import WARMUP_RUNS, CapturedStep
    torch.manual_seed(0)
    model = Transformer(_config()).cuda()
    master = MasterWeights(model)
    loss_module = _LossModule(master.compute, label_smoothing=0.1)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.0, device="cuda"), fused=True,
                                 capturable=True)
    step = CapturedStep(master, loss_module, optimizer, torch.device("cuda"))
    batch = batches[0]
    for _ in range(WARMUP_RUNS + 2):  # warm-ups, the capture, a replay; lr 0 keeps the weights
        master.zero_grad()
        step.micro_step(batch)
    assert batch.src.shape and len(step.graphs) == 1
    captured = master.flat_grad.clone()
    master.zero_grad()
    eager_loss = loss_module(*(tensor.cuda() for tensor in batch[:5]))
    eager_loss.backward()
    master.accumulate_gradients()
    eager = master.flat_grad.clone()
    fp32_model = copy.deepcopy(model)
    fp32_model.zero_grad(set_to_none=True)
    with fastformer.backend("reference"):
        _LossModule(fp32_model, 0.1)(*(tensor.cuda() for tensor in batch[:5])).backward()
    fp32 = torch.cat([parameter.grad.flatten() for parameter in fp32_model.parameters()])
    assert_close_lowp(captured, eager, fp32, "gradients")


def test_every_replay_draws_new_dropout_masks_and_never_syncs(batches):
    from fastformer.training.captured_step import CapturedStep
    torch.manual_seed(0)
    model = Transformer(_config(dropout=0.1)).cuda()
    master = MasterWeights(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.0, device="cuda"), fused=True,
                                 capturable=True)
    step = CapturedStep(master, _LossModule(master.compute, 0.1), optimizer, torch.device("cuda"))
    losses = []
    for run in range(6):
        if run == 4:
            torch.cuda.set_sync_debug_mode("error")
        step.micro_step(batches[0])
        torch.cuda.set_sync_debug_mode("default")
        losses.append(step.take_loss_sum().item())
    assert len(set(losses[3:])) == 3, f"replays repeated a dropout mask: {losses}"


def test_captured_update_clips_by_the_global_norm(batches):
    """--clip-norm in the captured update: the replayed update's gradient norm and clipped gradient (read back from
    Adam's first moment at lr 0) equal torch.nn.utils.clip_grad_norm_ applied to the eager step's gradient."""
    from fastformer.training.captured_step import WARMUP_RUNS, CapturedStep
    torch.manual_seed(0)
    model = Transformer(_config()).cuda()
    master = MasterWeights(model)
    loss_module = _LossModule(master.compute, label_smoothing=0.1)
    beta1 = 0.9
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.0, device="cuda"), betas=(beta1, 0.98),
                                 fused=True, capturable=True)
    batch = batches[0]
    scale = 1.0 / batch.target_tokens
    master.zero_grad()
    loss_module(*(tensor.cuda() for tensor in batch[:5])).backward()
    master.accumulate_gradients()
    eager = torch.nn.Parameter(torch.zeros_like(master.flat_grad))
    eager.grad = master.flat_grad.clone() * scale
    master.zero_grad()
    clip_norm = 0.05 * eager.grad.norm().item()  # well under the norm, so clipping acts
    eager_norm = torch.nn.utils.clip_grad_norm_([eager], clip_norm)

    step = CapturedStep(master, loss_module, optimizer, torch.device("cuda"), clip_norm=clip_norm)
    updates = WARMUP_RUNS + 2  # warm-ups, the capture, a replay; lr 0 keeps the weights and so the gradient
    for _ in range(updates):
        step.micro_step(batch)
        step.update(scale)
    assert step.update_graph is not None
    torch.testing.assert_close(step.grad_norm, eager_norm.float(), rtol=2e-2, atol=0.0)
    first_moment = torch.cat([optimizer.state[parameter]["exp_avg"].flatten()
                              for parameter in master.master_parameters])
    clipped = first_moment / (1.0 - beta1 ** updates)
    assert abs(clipped.norm().item() / clip_norm - 1.0) < 1e-3
    assert (clipped - eager.grad).norm() / eager.grad.norm() < 2e-2
