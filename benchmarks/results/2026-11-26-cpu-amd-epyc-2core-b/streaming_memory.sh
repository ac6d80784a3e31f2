cd /work/main
for n in 100k 1m; do
  /usr/bin/time -v .venv/bin/fastformer translate --out-dir runs/demo --input /tmp/in$n.en --output /tmp/out$n.de > /tmp/mem_$n.log 2>&1
  echo "$n rc=$?"
done
