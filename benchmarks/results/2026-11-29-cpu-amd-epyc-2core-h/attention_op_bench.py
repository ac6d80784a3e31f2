"""The self-attention op of a search alone, at the headline's shape of one thread's group (32 sentences of beam 4,
128 rows; 8 heads of 64; 6 layers' caches of 32 positions): a whole search's calls (steps 0-30, 6 layers a step),
with EVICT_MIB of other memory read between steps (as a step's weights pass through the caches) and each layer's
rows refreshed before its call (as its qkv projection leaves them in cache); neither is timed. Prints the best of
REPS searches (default 7) after 3 untimed: ms a search, GB/s of cache entries as the rows read them.
(../2026-11-29-cpu-amd-epyc-2core-e/attention_step_bench.py, with the rows refreshed and SENTENCES and LAYOUT added.)

    PYTHONPATH=<a build's checkout> python attention_op_bench.py CACHE EVICT_MIB INDIRECTION [SENTENCES]

CACHE: half (the int8 and bfloat16 searches') or float (float32's). INDIRECTION: random (each row's position p from a
random beam of its sentence), shared (every beam's history is beam 0's), own (each row reads its own slot).
LAYOUT=positions (environment): caches [slots, positions, heads, head_dim] passed as heads-first views, for
position_major_trial.patch's build, which reads the caches' strides.
"""

import os
import sys
import time

import torch

from fastformer.decoding.compiled import extension

torch.set_num_threads(1)
cache, evict_mib, indirection_kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sentences = int(sys.argv[4]) if len(sys.argv) > 4 else 32
dtype = {"half": torch.float16, "float": torch.float32}[cache]
BEAM, HEADS, HEAD_DIM, CACHE_LEN, LAYERS, STEPS = 4, 8, 64, 32, 6, 31
slots = sentences * BEAM
extension()  # registers torch.ops.fastformer
generator = torch.Generator().manual_seed(0)


def cache_tensor() -> torch.Tensor:
    if os.environ.get("LAYOUT") == "positions":
        return torch.zeros(slots, CACHE_LEN, HEADS, HEAD_DIM, dtype=dtype).permute(0, 2, 1, 3)
    return torch.zeros(slots, HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)


caches = [(cache_tensor(), cache_tensor()) for _ in range(LAYERS)]
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
    """One search's calls -> their seconds."""
    seconds = 0.0
    for step in range(STEPS):
        if evict is not None:
            evict.sum()
        for layer in range(LAYERS):
            qkv[layer].add_(0)
            start = time.perf_counter()
            torch.ops.fastformer.self_attention_step(qkv[layer], *caches[layer], indirection, row_slots, BEAM, step)
            seconds += time.perf_counter() - start
    return seconds


for _ in range(3):
    search()
best = min(search() for _ in range(int(os.environ.get("REPS", "7"))))
entry_bytes = HEADS * HEAD_DIM * dtype.itemsize * 2  # a position's keys and values, every head
read = sum(slots * (step + 1) for step in range(STEPS)) * LAYERS * entry_bytes
print(f"{cache} {indirection_kind} evict {evict_mib} MiB, {sentences} sentences: {best * 1e3:.1f} ms a search, "
      f"{read / best / 1e9:.1f} GB/s of entries as rows read them", flush=True)
