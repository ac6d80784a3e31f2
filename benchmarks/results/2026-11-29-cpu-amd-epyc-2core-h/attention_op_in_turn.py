"""attention_op_bench.py in processes of their own, in turn (which goes first alternating), ROUNDS rounds, for each
setting given -> each setting's ms a search, its median and every round's.

    python attention_op_in_turn.py CACHE INDIRECTION ROUNDS SETTING [SETTING ...]

SETTING: VAR=VALUE[+VAR=VALUE...], the environment of that setting's processes (PYTHONPATH picks a build; FF_SPLIT
is split_prefetch_switch.patch's switch; LAYOUT is attention_op_bench.py's).
"""
import os
import statistics
import subprocess
import sys
from pathlib import Path

cache, indirection, rounds, settings = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
bench = Path(__file__).with_name("attention_op_bench.py")
ms = {s: [] for s in settings}
for r in range(rounds):
    for setting in settings if r % 2 == 0 else settings[::-1]:
        env = dict(os.environ, REPS="5")
        env.update(kv.split("=", 1) for kv in setting.split("+"))
        out = subprocess.run([sys.executable, str(bench), cache, "64", indirection], env=env, check=True,
                             capture_output=True, text=True).stdout
        ms[setting].append(float(out.split(": ")[1].split(" ms")[0]))
for setting in settings:
    print(f"{cache} {indirection} {setting}: median {statistics.median(ms[setting]):.2f} ms {ms[setting]}", flush=True)
