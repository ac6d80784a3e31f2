# Every measurement of this folder in turn, nothing else running; from the checkout's root or elsewhere:
#   PYTHON=/path/to/.venv/bin/python bash run.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$1
python=${PYTHON:-python}
mkdir -p "$out"
g++ -O3 -mavx512f -mavx512vnni -mavx2 -mfma -o "$out/peak_probe" "$here/peak_probe.cpp"
for i in 1 2 3; do "$out/peak_probe" 2>/dev/null; done > "$out/peak_probe.jsonl"
"$python" "$here/limits.py" gemm > "$out/gemm.json"
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FASTFORMER_CPU_ISA=avx2 \
    "$python" "$here/limits.py" float32 > "$out/float32_capped_avx2.json"
"$python" "$here/limits.py" float32 > "$out/float32.json"
"$python" "$here/limits.py" shares > "$out/shares.json"
for beam in 1 4; do PYTHON=$python bash "$here/lockstep.sh" $beam; done > "$out/lockstep.jsonl"
OMP_NUM_THREADS=2 "$python" "$here/../../cpu_options.py" --one-process --systems greedy sampling --rounds 20 \
    --out "$out/sampling_greedy.json" > "$out/sampling_greedy.log"
rm "$out/peak_probe"
