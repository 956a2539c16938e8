#!/usr/bin/env bash
# Run every benchmark in bench/ with its default (full) settings; each prints ratios against a baseline
# measured in the same run. Pass QUICK=1 for shortened runs. Uses the python on PATH (make bench sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
quick=${QUICK:-0}
run() { echo; echo "=== $*"; python "$@"; }
if [ "$quick" = 1 ]; then
  run bench/engine_overhead.py --steps 100 --rounds 3
  run bench/dp_throughput.py --steps 50 --rounds 2
  run bench/cpu_adam.py --params 10000000 --rounds 3
  run bench/checkpoint.py --params-millions 5 --repeats 3
  run bench/launcher_overhead.py --rounds 3
  run bench/aio.py --size-mib 128 --rounds 3
  run bench/activation_checkpointing.py --steps 3 --rounds 2
  run bench/pipeline.py --rounds 2 --skip-ckpt
  run bench/gpt_throughput.py --steps 6 --rounds 1
  run bench/soak.py --runs 8
  run bench/tp_sp_memory.py --hidden 128 --layers 2 --seq 256
  run bench/weight_sync.py --layers 8 --rounds 3
  run bench/rlhf.py --rounds 2 --new-tokens 16 --cycles 100 --rss-every 10
else
  run bench/engine_overhead.py
  run bench/dp_throughput.py
  run bench/cpu_adam.py
  run bench/checkpoint.py
  run bench/launcher_overhead.py
  run bench/aio.py
  run bench/activation_checkpointing.py
  run bench/pipeline.py
  run bench/gpt_throughput.py
  run bench/soak.py --runs 200
  run bench/tp_sp_memory.py
  run bench/weight_sync.py
  run bench/rlhf.py
fi
