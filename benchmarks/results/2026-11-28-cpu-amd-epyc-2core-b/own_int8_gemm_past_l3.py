"""own_int8_gemm.py of ../2026-11-27-cpu-amd-epyc-2core-i/ at 4 rows (one sentence's beams) on weights that fit the
32 MiB L3 (512 -> 37000: 18 MiB) and that do not (512 -> 150000: 73 MiB; 2048 -> 37000: 72 MiB), run as that script
is, uncapped and under FASTFORMER_CPU_ISA=avx2."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-cpu-amd-epyc-2core-i"))
import own_int8_gemm  # noqa: E402

own_int8_gemm.SHAPES = [(4, 512, 37000), (4, 512, 150000), (4, 2048, 37000)]

if __name__ == "__main__":
    own_int8_gemm.main()
