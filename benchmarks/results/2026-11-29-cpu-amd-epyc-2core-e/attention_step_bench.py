"""The self-attention op of a search alone, at the headline's shape of one thread's group: 32 sentences of beam 4
(128 rows), 8 heads of 64, 6 layers' caches of 32 positions; a whole search's calls (steps 0-30, 6 layers a step)
with EVICT_MIB of other memory read between steps (as a step's weights pass through the caches; its time is not
counted). Prints the best of 7 searches after 3 unTimed: ms a search, GB/s of cache entries as the rows read them.

    PYTHONPATH=<a build's checkout> python attention_step_bench.py CACHE EVICT_MIB INDIRECTION

CACHE: half (the int8 and bfloat16 searches'), float (float32's), int8 (attention_int8_cache.patch's trial) or
bfloat16 (../2026-11-29-cpu-amd-epyc-2core-f/attention_bfloat16_caches.patch's).
INDIRECTION: random (each row's position p from a random beam of its sentence), shared (every beam's history is
beam 0's: its entries read 4 times), own (each row reads its own slot's entries only).
"""

import sys
import time

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
cache, evict_mib, indirection_kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dtype = {"half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32, "int8": torch.int8}[cache]
SENTENCES, BEAM, HEADS, HEAD_DIM, CACHE_LEN, LAYERS, STEPS = 32, 4, 8, 64, 32, 6, 31
slots = SENTENCES * BEAM
extension()  # registers torch.ops.fastformer
generator = torch.Generator().manual_seed(0)
caches = [(torch.zeros(slots, HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype),
           torch.zeros(slots, HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)) for _ in range(LAYERS)]
qkv = [torch.randn(slots, 3 * HEADS * HEAD_DIM, generator=generator) for _ in range(LAYERS)]
row_slots = torch.arange(slots, dtype=torch.int32)
if indirection_kind == "random":
    indirection = torch.randint(0, BEAM, (slots, CACHE_LEN), generator=generator, dtype=torch.int32)
elif indirection_kind == "own":
    indirection = (torch.arange(slots, dtype=torch.int32) % BEAM).unsqueeze(1).expand(slots, CACHE_LEN).contiguous()
else:
    indirection = torch.zeros(slots, CACHE_LEN, dtype=torch.int32)
evict = torch.zeros(evict_mib * 2**18) if evict_mib else None


def search() -> float:
    """One search's calls -> its seconds, the eviction's not counted."""
    seconds = 0.0
    for step in range(STEPS):
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        for layer in range(LAYERS):
            torch.ops.fastformer.self_attention_step(qkv[layer], *caches[layer], indirection, row_slots, BEAM, step)
        seconds += time.perf_counter() - start
    return seconds


for _ in range(3):
    search()
best = min(search() for _ in range(7))
entry_bytes = HEADS * HEAD_DIM * dtype.itemsize * 2  # a position's keys and values, every head
read = sum(slots * (step + 1) for step in range(STEPS)) * LAYERS * entry_bytes
print(f"{cache} {indirection_kind} evict {evict_mib} MiB: {best * 1e3:.1f} ms a search, "
      f"{read / best / 1e9:.1f} GB/s of entries as rows read them", flush=True)
