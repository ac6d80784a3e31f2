"""Where does a float32 translation start to differ alone and in a batch? The compiled encoder's memory of each
sentence alone against its rows in the padded batch, then the search's scores, each twice (run-to-run determinism)."""
import torch
from test_alignment import LENGTHS, SEARCH, padded_sources, peaked_model

from fastformer.decoding.search import encode, model_compiled

model = peaked_model()
src = padded_sources(model, LENGTHS, seed=4)
compiled = model_compiled(model, "float32")
memory, _ = encode(model, src, compiled)
again, _ = encode(model, src, compiled)
print("encoder batch run to run equal:", torch.equal(memory, again))
for i, length in enumerate(LENGTHS):
    alone, _ = encode(model, src[i:i + 1, :length], compiled)
    diff = (alone[0] - memory[i, :length]).abs().max().item()
    print(f"sentence {i} (length {length}): encoder alone vs batch max diff {diff:.3g}")
search = dict(beam_size=4, n_best=2, compute_type="float32", shrink="every_step", **SEARCH)
batch = model.translate(src, **search)
print("search batch run to run equal:", batch == model.translate(src, **search))
for i, length in enumerate(LENGTHS):
    alone = model.translate(src[i:i + 1, :length], **search)[0]
    print(f"sentence {i}: scores batch {[h.score for h in batch[i]]} alone {[h.score for h in alone]}")
