"""CTranslate2 int16 (a compute type only its MKL backend has) at the headline point through cpu_decoding.py's
worker: the base model with a 37k vocabulary and the same random weights, 64 sentences of 20 tokens, beam 4, the
decoding length fixed -> {"64": [seconds, checksum, warm-up calls]} on stdout.

    CT2_USE_MKL=1 OMP_NUM_THREADS=2 python ctranslate2_int16_worker.py inter|intra 2
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding  # noqa: E402

threading, threads = sys.argv[1], int(sys.argv[2])
cpu_decoding.run_worker("ctranslate2-int16", threading, cpu_decoding.Point(threads, 4, 20, (64,)),
                        argparse.Namespace(shape="b", vocab=37000, seed=0))
