"""The extension fastformer._C: its torch ops against the reference attention, the torch.library checks, and (on a
GPU) its CUDA kernels against the CPU ones and the reference."""

import math
import sys
from pathlib import Path

import pytest
import torch

from fastformer.reference.attention import attention
from tolerances import FP32, assert_close_lowp

_C = pytest.importorskip("fastformer._C", reason="fastformer._C is not built")

HEADS, HEAD_DIM = 2, 32


def self_attention_problem(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                           head_dim: int = HEAD_DIM, step: int = 4):
    """A random cache of 3 sentences x beam 2, a random cache indirection, and 4 rows at `step` (a subset of
    slots)."""
    generator = torch.Generator().manual_seed(seed)
    n_slots, beam, cache_len = 6, 2, step + 3
    k_cache = torch.randn(n_slots, HEADS, cache_len, head_dim, generator=generator)
    v_cache = torch.randn(n_slots, HEADS, cache_len, head_dim, generator=generator)
    indirection = torch.randint(0, beam, (n_slots, cache_len), generator=generator, dtype=torch.int32)
    row_slots = torch.tensor([5, 0, 3, 2], dtype=torch.int32)
    qkv = torch.randn(len(row_slots), 3 * HEADS * head_dim, generator=generator)
    tensors = [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
               for t in (qkv, k_cache, v_cache, indirection, row_slots)]
    return (*tensors, beam, step)


def self_attention_expected(qkv, k_cache, v_cache, indirection, row_slots, beam, step,
                            attend=attention) -> torch.Tensor:
    """`attend` (the reference attention) over each row's keys, gathered through the indirection (own slot at
    `step`)."""
    heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    d = heads * head_dim
    outputs = []
    for row, slot in enumerate(row_slots.tolist()):
        sources = [slot - slot % beam + b for b in indirection[slot, :step].tolist()]
        keys = torch.stack([k_cache[source, :, p] for p, source in enumerate(sources)]
                           + [qkv[row, d:2 * d].view(heads, head_dim)])
        values = torch.stack([v_cache[source, :, p] for p, source in enumerate(sources)]
                             + [qkv[row, 2 * d:].view(heads, head_dim)])
        q = qkv[row, :d].view(1, 1, heads, head_dim)
        outputs.append(attend(q, keys[None], values[None]).reshape(d))
    return torch.stack(outputs)


def cross_attention_problem(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                            head_dim: int = HEAD_DIM, src_len: int = 5):
    """3 sentences x beam 2 of keys/values of src_len positions, the first sentence at full length."""
    generator = torch.Generator().manual_seed(seed)
    n_sentences, beam = 3, 2
    k = torch.randn(n_sentences, HEADS, src_len, head_dim, generator=generator)
    v = torch.randn(n_sentences, HEADS, src_len, head_dim, generator=generator)
    src_lengths = torch.tensor([src_len, 1, (src_len + 1) // 2], dtype=torch.int32)
    row_slots = torch.tensor([4, 5, 0, 3], dtype=torch.int32)
    q = torch.randn(len(row_slots), HEADS * head_dim, generator=generator)
    tensors = [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
               for t in (q, k, v, src_lengths, row_slots)]
    return (*tensors, beam)


def cross_attention_expected(q, k, v, src_lengths, row_slots, beam, attend=attention) -> torch.Tensor:
    """`attend` (the reference attention) of each row over its sentence's keys."""
    sentences = row_slots.long() // beam
    out = attend(q.view(-1, 1, k.shape[1], k.shape[3]), k[sentences].transpose(1, 2), v[sentences].transpose(1, 2),
                    k_lengths=src_lengths[sentences])
    return out.reshape(q.shape)


def test_self_attention_op_matches_the_reference():
    qkv, k_cache, v_cache, indirection, row_slots, beam, step = self_attention_problem()
    expected = self_attention_expected(qkv, k_cache, v_cache, indirection, row_slots, beam, step)
    out = torch.ops.fastformer.self_attention_step(qkv, k_cache, v_cache, indirection, row_slots, beam, step)
    torch.testing.assert_close(out, expected, **FP32)
    d = HEADS * HEAD_DIM
    for row, slot in enumerate(row_slots.tolist()):  # the step's key/value were appended in place
        torch.testing.assert_close(k_cache[slot, :, step], qkv[row, d:2 * d].view(HEADS, HEAD_DIM), rtol=0, atol=0)
        torch.testing.assert_close(v_cache[slot, :, step], qkv[row, 2 * d:].view(HEADS, HEAD_DIM), rtol=0, atol=0)


def test_self_attention_op_splits_its_rows_across_threads_without_changing_results():
    """Enough rows at a late enough step that two threads each take a part of them (a task of at least 2^17
    multiply-adds, csrc/decoder.cpp): the outputs and the appended entries are one thread's bitwise, and the
    reference's within fp32."""
    generator = torch.Generator().manual_seed(3)
    n_slots, beam, step, n_rows = 256, 4, 40, 128
    k_cache = torch.randn(n_slots, HEADS, step + 1, HEAD_DIM, generator=generator)
    v_cache = torch.randn(n_slots, HEADS, step + 1, HEAD_DIM, generator=generator)
    indirection = torch.randint(0, beam, (n_slots, step + 1), generator=generator, dtype=torch.int32)
    row_slots = torch.randperm(n_slots, generator=generator)[:n_rows].to(torch.int32)
    qkv = torch.randn(n_rows, 3 * HEADS * HEAD_DIM, generator=generator)
    assert n_rows >= 2 * (2 ** 17 // (2 * HEADS * HEAD_DIM * (step + 1)))  # two tasks or more

    def on_threads(threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v = k_cache.clone(), v_cache.clone()
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return torch.ops.fastformer.self_attention_step(qkv, k, v, indirection, row_slots, beam, step), k, v
        finally:
            torch.set_num_threads(previous)

    one, two = on_threads(1), on_threads(2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    expected = self_attention_expected(qkv, k_cache, v_cache, indirection, row_slots, beam, step)
    torch.testing.assert_close(two[0], expected, **FP32)


def test_cross_attention_op_matches_the_reference():
    problem = cross_attention_problem()
    out = torch.ops.fastformer.cross_attention(*problem)
    torch.testing.assert_close(out, cross_attention_expected(*problem), **FP32)


@pytest.mark.parametrize("half", [False, True])
def test_cross_attention_op_reads_views_of_linear_outputs(half):
    """The encoder hands the op its qkv's parts where they lie: q a column range of [rows, 3 * d_model], k and v
    permuted views of [n_sentences, src_len, 2, heads, head_dim]. The result equals the op's on contiguous copies
    bitwise, and the reference."""
    q, k, v, src_lengths, row_slots, beam = cross_attention_problem(src_len=19)
    if half:
        k, v = k.half(), v.half()
    n_sentences, heads, src_len, head_dim = k.shape
    d = heads * head_dim
    qkv = torch.full((q.shape[0], 3 * d), float("nan"))
    qkv[:, :d] = q
    rows = torch.stack([k, v]).permute(1, 3, 0, 2, 4).contiguous()  # [n_sentences, src_len, 2, heads, head_dim]
    keys_values = rows.permute(2, 0, 3, 1, 4)
    assert not keys_values[0].is_contiguous() and not qkv[:, :d].is_contiguous()
    out = torch.ops.fastformer.cross_attention(qkv[:, :d], keys_values[0], keys_values[1], src_lengths, row_slots,
                                               beam)
    assert torch.equal(out, torch.ops.fastformer.cross_attention(q, k, v, src_lengths, row_slots, beam))
    torch.testing.assert_close(out, cross_attention_expected(q, k.float(), v.float(), src_lengths, row_slots, beam),
                               **FP32)


def test_cross_attention_op_ignores_the_strides_of_dimensions_of_size_1():
    """One sentence: a contiguous k whose size-1 sentence dimension has another stride than v's is the same layout."""
    q, k, v, src_lengths, _, beam = cross_attention_problem()
    q, lengths, slots = q[:beam], src_lengths[:1], torch.arange(beam, dtype=torch.int32)
    k_odd = k[0].unsqueeze(1).transpose(0, 1)  # [1, heads, src_len, head_dim], strides (src_len * head_dim, ...)
    assert k_odd.is_contiguous() and k_odd.stride() != v[:1].stride()
    expected = torch.ops.fastformer.cross_attention(q, k[:1].clone(), v[:1].clone(), lengths, slots, beam)
    assert torch.equal(torch.ops.fastformer.cross_attention(q, k_odd, v[:1], lengths, slots, beam), expected)


# head_dim 12 is no multiple of the CPU loops' 8 lanes, 40 and 96 take their 4- and 8-vector blocks of values; 19
# keys are two blocks of 8 and a tail of 3.
@pytest.mark.parametrize("head_dim", [12, 40, 96])
def test_attention_ops_at_every_head_size_and_length(head_dim):
    self_problem = self_attention_problem(head_dim=head_dim, step=18)
    expected = self_attention_expected(*self_problem)
    torch.testing.assert_close(torch.ops.fastformer.self_attention_step(*self_problem), expected, **FP32)
    cross_problem = cross_attention_problem(head_dim=head_dim, src_len=19)
    torch.testing.assert_close(torch.ops.fastformer.cross_attention(*cross_problem),
                               cross_attention_expected(*cross_problem), **FP32)


@pytest.mark.parametrize("head_dim", [12, 32, 96])
def test_attention_ops_read_float16_keys_and_values_as_their_float32_values(head_dim):
    """On the CPU the caches and the encoder's keys/values may be float16 beside float32 rows (the int8 and bfloat16
    searches keep them so): the result is the float32 op's over their values, and the step's key and value are
    appended rounded to float16."""
    qkv, k_cache, v_cache, indirection, row_slots, beam, step = self_attention_problem(head_dim=head_dim, step=18)
    k_half, v_half = k_cache.half(), v_cache.half()
    out = torch.ops.fastformer.self_attention_step(qkv, k_half, v_half, indirection, row_slots, beam, step)
    d = HEADS * head_dim
    rounded_qkv = torch.cat([qkv[:, :d], qkv[:, d:].half().float()], dim=1)
    expected = self_attention_expected(rounded_qkv, k_half.float(), v_half.float(), indirection, row_slots, beam,
                                       step)
    torch.testing.assert_close(out, expected, **FP32)
    for row, slot in enumerate(row_slots.tolist()):
        assert torch.equal(k_half[slot, :, step], qkv[row, d:2 * d].view(HEADS, head_dim).half())
        assert torch.equal(v_half[slot, :, step], qkv[row, 2 * d:].view(HEADS, head_dim).half())
    q, k, v, src_lengths, cross_rows, beam = cross_attention_problem(head_dim=head_dim, src_len=19)
    torch.testing.assert_close(
        torch.ops.fastformer.cross_attention(q, k.half(), v.half(), src_lengths, cross_rows, beam),
        cross_attention_expected(q, k.half().float(), v.half().float(), src_lengths, cross_rows, beam), **FP32)


def test_ops_pass_torch_library_checks():
    # Schema (the declared mutations), fake/meta kernels and dispatcher registration, as torch.compile needs them.
    for op, args in ((torch.ops.fastformer.self_attention_step.default, self_attention_problem()),
                     (torch.ops.fastformer.cross_attention.default, cross_attention_problem())):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_ops_reject_bad_inputs():
    qkv, k_cache, v_cache, indirection, row_slots, beam, step = self_attention_problem()
    with pytest.raises(RuntimeError, match="step must be in"):
        torch.ops.fastformer.self_attention_step(qkv, k_cache, v_cache, indirection, row_slots, beam, 7)
    with pytest.raises(RuntimeError, match="indirection must be int32"):
        torch.ops.fastformer.self_attention_step(qkv, k_cache, v_cache, indirection.long(), row_slots, beam, step)
    q, k, v, src_lengths, row_slots, beam = cross_attention_problem()
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.fastformer.cross_attention(q.double(), k.double(), v.double(), src_lengths, row_slots, beam)
    with pytest.raises(RuntimeError, match="k and v must have the same strides"):
        positions_first = v.transpose(1, 2).contiguous().transpose(1, 2)  # head_dim contiguous, other strides
        torch.ops.fastformer.cross_attention(q, k, positions_first, src_lengths, row_slots, beam)
    with pytest.raises(RuntimeError, match="head_dim contiguous"):
        flipped = k.transpose(2, 3).contiguous().transpose(2, 3)
        torch.ops.fastformer.cross_attention(q, flipped, flipped, src_lengths, row_slots, beam)


@pytest.mark.parametrize("case", ["src_lengths past src_len", "src_lengths 0", "row_slots past the sentences",
                                  "row_slots negative", "self row_slots past the slots", "indirection past the beam"])
def test_ops_refuse_indices_out_of_range(case):
    """Every index an op reads by is checked on the CPU: out of range, it would read outside the caches."""
    qkv, k_cache, v_cache, indirection, self_slots, beam, step = self_attention_problem()
    q, k, v, src_lengths, row_slots, cross_beam = cross_attention_problem()
    src_len, n_slots = k.shape[2], k_cache.shape[0]
    bad = {
        "src_lengths past src_len": ("cross", "src_lengths", src_lengths.clone().fill_(src_len + 1)),
        "src_lengths 0": ("cross", "src_lengths", src_lengths.clone().fill_(0)),
        "row_slots past the sentences": ("cross", "row_slots", row_slots.clone().fill_(k.shape[0] * cross_beam)),
        "row_slots negative": ("cross", "row_slots", row_slots.clone().fill_(-3)),
        "self row_slots past the slots": ("self", "row_slots", self_slots.clone().fill_(n_slots)),
        "indirection past the beam": ("self", "indirection", indirection.clone().fill_(beam)),
    }
    op, name, value = bad[case]
    with pytest.raises(RuntimeError, match=f"{name} must lie in"):
        if op == "cross":
            arguments = {"src_lengths": src_lengths, "row_slots": row_slots, name: value}
            torch.ops.fastformer.cross_attention(q, k, v, arguments["src_lengths"], arguments["row_slots"], cross_beam)
        else:
            arguments = {"indirection": indirection, "row_slots": self_slots, name: value}
            torch.ops.fastformer.self_attention_step(qkv, k_cache, v_cache, arguments["indirection"],
                                                     arguments["row_slots"], beam, step)


@pytest.mark.gpu
def test_cuda_attention_ops_match_cpu_fp32():
    for make, op in ((self_attention_problem, torch.ops.fastformer.self_attention_step),
                     (cross_attention_problem, torch.ops.fastformer.cross_attention)):
        cpu_problem, cuda_problem = make(), make("cuda")
        torch.testing.assert_close(op(*cuda_problem).cpu(), op(*cpu_problem), **FP32)
        torch.testing.assert_close(cuda_problem[1].cpu(), cpu_problem[1], rtol=0, atol=0)  # same cache writes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_attention_ops_low_precision(dtype):
    for make, op, expected_of in ((self_attention_problem, torch.ops.fastformer.self_attention_step,
                                   self_attention_expected),
                                  (cross_attention_problem, torch.ops.fastformer.cross_attention,
                                   cross_attention_expected)):
        reference = expected_of(*make())  # fp32 CPU
        fused = op(*make("cuda", dtype)).float().cpu()
        plain = expected_of(*make("cuda", dtype), attend=plain_attention).float().cpu()
        assert_close_lowp(fused, plain, reference, name=f"{op} {dtype}")


def plain_attention(q, k, v, k_lengths=None) -> torch.Tensor:
    """Attention in plain PyTorch in q's own (low) precision: [batch, q_len, heads, head_dim] like the reference."""
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if k_lengths is not None:
        hidden = torch.arange(k.shape[1], device=k.device)[None, :] >= k_lengths[:, None]
        scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.transpose(1, 2)).transpose(1, 2)


def test_a_missing_extension_is_an_import_error_saying_how_to_build_it(monkeypatch):
    """An ImportError, which the CLI prints as one line, saying why (unloadable_extension_message's cases below)."""
    import fastformer
    from fastformer.decoding.compiled import extension, unloadable_extension_message

    monkeypatch.delattr(fastformer, "_C")
    monkeypatch.setitem(sys.modules, "fastformer._C", None)
    with pytest.raises(ImportError) as raised:
        extension()
    package_dir = Path(fastformer.__file__).resolve().parent
    assert str(raised.value) == unloadable_extension_message(package_dir, raised.value.__cause__)


def test_the_missing_extensions_message_tells_each_case_apart(tmp_path):
    """A built extension that does not load (another torch's: an undefined symbol) is named with the loader's
    reason, not called unbuilt; a source checkout without one says to run the installed package; else: build it."""
    from fastformer.decoding.compiled import unloadable_extension_message

    package = tmp_path / "fastformer"
    package.mkdir()
    error = ImportError("/x/_C.so: undefined symbol: _ZN3c10foo\nmore")
    assert unloadable_extension_message(package, error) == ("fastformer._C is not built: install with "
                                                            "`pip install --no-build-isolation .`")
    (tmp_path / "setup.py").write_text("")
    assert "was imported from the source checkout " + str(tmp_path) in unloadable_extension_message(package, error)
    (package / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    message = unloadable_extension_message(package, error)
    assert message.startswith(f"fastformer's compiled extension {package / '_C.cpython-311-x86_64-linux-gnu.so'} "
                              "does not load (/x/_C.so: undefined symbol: _ZN3c10foo): it was built against another "
                              "torch or Python") and "\n" not in message
