"""How many of a row's 64-output tiles the int8 summary would stop at (a tile holding an output above the row's
running k-th best, scanned in id order), from each step's float32 logits of a greedy and a top-10 sampled search of
12 sentences: with the bar starting at -inf, and with it starting just below the k-th best of the outputs at the
step before's k best ids (what seeded_bars.patch computes). EOS, PAD and BOS are barred, as in the search.

    python seeded_bars_simulation.py random               # the benchmarks' random base model, 37k vocabulary
    python seeded_bars_simulation.py CHECKPOINT           # a trained checkpoint, on the bundled test sentences
"""

import sys

import numpy as np
import torch

import fastformer
from fastformer.data import BUNDLED_CORPUS, read_lines

torch.manual_seed(0)
if sys.argv[1] == "random":
    model = fastformer.Transformer(fastformer.TransformerConfig.base(37000, dropout=0.0)).eval()
    src = torch.randint(3, 37000, (12, 21), generator=torch.Generator().manual_seed(0))
    src[:, -1] = model.config.eos_id
else:
    translator = fastformer.load_translator(sys.argv[1], device="cpu")
    model = translator.model
    ids = translator.source_tokenizer.encode(read_lines(BUNDLED_CORPUS / "test.en")[:12])
    src = torch.zeros(len(ids), max(len(i) for i in ids) + 1, dtype=torch.long)
    for r, row in enumerate(ids):
        src[r, :len(row) + 1] = torch.tensor(row + [model.config.eos_id])
config = model.config


def stops(row: np.ndarray, k: int, bar: float) -> int:
    """The tiles of 64 outputs, in id order, that hold an output above the running bar."""
    best, n = [], 0
    for start in range(0, len(row), 64):
        tile = row[start:start + 64]
        if (tile > bar).any():
            n += 1
            for value in tile[tile > bar]:
                if value > bar:
                    best = sorted(best + [value], reverse=True)[:k]
                    if len(best) == k:
                        bar = best[-1]
    return n


with torch.no_grad():
    for search, options in (("greedy", {}), ("top-10 sampled", {"sampling_topk": 10, "seed": 1})):
        hypotheses = model.translate(src, beam_size=1, max_len_b=10, **options)
        for k in (1, 10):
            unseeded, seeded = [], []
            for s in range(src.shape[0]):
                target_in = torch.tensor([[config.bos_id] + hypotheses[s][0].tokens])
                logits = model(src[s:s + 1], target_in)[0].float().numpy()
                logits[:, [config.pad_id, config.bos_id, config.eos_id]] = -np.inf
                for t in range(1, logits.shape[0]):
                    before = np.argsort(-logits[t - 1], kind="stable")[:k]
                    unseeded.append(stops(logits[t], k, -np.inf))
                    seeded.append(stops(logits[t], k, np.nextafter(logits[t][before].min(), -np.inf)))
            print(f"{sys.argv[1]}, {search} search, k {k}: {np.mean(unseeded):.1f} tiles a row unseeded, "
                  f"{np.mean(seeded):.1f} seeded ({len(unseeded)} rows of {logits.shape[1] // 64 + 1} tiles)",
                  flush=True)
