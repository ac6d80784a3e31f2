"""One decoding step's attention ops at the headline shape (base model: 8 heads of 64; 64 sentences, beam 4: 256
rows), float16 caches as the int8 search keeps them, one thread: the best of many calls, in milliseconds a layer.

    OMP_NUM_THREADS=1 PYTHONPATH=<a build's checkout> python attention_step.py

- self-attention at step 16 (17 positions) over caches of 32 positions, half the sentences' beams sharing their
  prefix (the indirection sends them to beam 0's slot) and half each on a slot of its own: one layer's caches
  called again and again (in cache), and six layers' called in turn after 48 MB were written elsewhere (their
  entries read from memory, as in the search, where the GEMMs' weights pass between two calls);
- cross-attention over 21 source positions.
"""

import time

import torch

import fastformer._C  # noqa: F401  (registers torch.ops.fastformer)

torch.set_num_threads(1)
SENTENCES, BEAM, HEADS, HEAD_DIM, CACHE_LEN, STEP, SOURCE_LEN = 64, 4, 8, 64, 32, 16, 21
ROWS = SENTENCES * BEAM
generator = torch.Generator().manual_seed(0)


def best_ms(call, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def caches():
    shape = (ROWS, HEADS, CACHE_LEN, HEAD_DIM)
    return torch.randn(shape, generator=generator).half(), torch.randn(shape, generator=generator).half()


indirection = torch.zeros(ROWS, CACHE_LEN, dtype=torch.int32)
for slot in range(ROWS):
    if (slot // BEAM) % 2:
        indirection[slot] = slot % BEAM
qkv = torch.randn(ROWS, 3 * HEADS * HEAD_DIM, generator=generator)
row_slots = torch.arange(ROWS, dtype=torch.int32)
self_attention = torch.ops.fastformer.self_attention_step
layers = [caches() for _ in range(6)]
elsewhere = torch.empty(48 << 20, dtype=torch.uint8)


def one_layer():
    self_attention(qkv, *layers[0], indirection, row_slots, BEAM, STEP)


def six_layers_from_memory() -> float:
    elsewhere.add_(1)
    start = time.perf_counter()
    for k_cache, v_cache in layers:
        self_attention(qkv, k_cache, v_cache, indirection, row_slots, BEAM, STEP)
    return time.perf_counter() - start


keys = torch.randn(SENTENCES, HEADS, SOURCE_LEN, HEAD_DIM, generator=generator).half()
values = torch.randn(SENTENCES, HEADS, SOURCE_LEN, HEAD_DIM, generator=generator).half()
queries = torch.randn(ROWS, HEADS * HEAD_DIM, generator=generator)
source_lengths = torch.full((SENTENCES,), SOURCE_LEN, dtype=torch.int32)


def cross():
    torch.ops.fastformer.cross_attention(queries, keys, values, source_lengths, row_slots, BEAM)


print(f"self-attention, one layer in cache: {best_ms(one_layer, 200):.3f} ms")
print(f"self-attention, six layers from memory: {min(six_layers_from_memory() for _ in range(30)) * 1e3 / 6:.3f} ms "
      "a layer")
print(f"cross-attention: {best_ms(cross, 200):.3f} ms")
