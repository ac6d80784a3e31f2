for round in 1 2 3; do
  for side in base new; do
    if [[ $side == base ]]; then P=/tmp/base; else P=/work/main/.venv/lib/python3.11/site-packages; fi
    PYTHONPATH=$P OMP_NUM_THREADS=2 /work/main/.venv/bin/python /work/main/benchmarks/cpu_decoding.py --shape b --vocab 37000 \
      --systems fastformer-int8 fastformer-float32 --sentences 64 --threads 2 --beam 4 --source-tokens 20 --rounds 1 \
      --out $OUT/$side-$round.json > $OUT/$side-$round.log 2>&1
    echo "$side $round rc=$?"
  done
done
