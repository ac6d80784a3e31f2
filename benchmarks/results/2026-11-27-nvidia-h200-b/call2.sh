#!/usr/bin/env bash
# Second call on the same warm machine: pack call 1's outputs (OLD_OUT) into one archive, then the batch-invariance
# tests on this machine's Intel Xeon CPU with the GEMM probe of tests/test_beam_search.py, whose verdict is printed.
set -uo pipefail
tar -czf "$OUT/call1-out.tgz" -C "${OLD_OUT:?}" .
python3 -c 'import fastformer._C' 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-deps .
lscpu > "$OUT/lscpu.txt"
REPO=$(pwd)
cd "$OUT" && PYTHONPATH="$REPO/tests" python3 - <<'PY' 2>&1 | tee "$OUT/gemm_probe.log"
import torch
import fastformer
from test_beam_search import gemm_rows_depend_on_the_batch
torch.manual_seed(0)
model = fastformer.Transformer(fastformer.TransformerConfig.tiny(1000, dropout=0.0)).eval()
for compute_type in ("float32", "int8", "bfloat16"):
    print(compute_type, "rows depend on the batch:", gemm_rows_depend_on_the_batch(model, compute_type), flush=True)
PY
cd "$OUT" && timeout 240 python3 -m pytest -q -ra -n 8 -p no:cacheprovider \
    "$REPO/tests/test_alignment.py::test_attention_does_not_depend_on_the_batch" \
    "$REPO/tests/test_search_options.py::test_every_option_translates_a_sentence_the_same_alone_and_in_a_batch" \
    2>&1 | tail -n 30 | tee "$OUT/pytest-batch-invariance.log"
