#!/usr/bin/env bash
# A clean install runs a 2-rank job (issue 38 item 0). In a fresh venv (no --system-site-packages):
# `pip install torch==2.13.0`, then `pip install <this checkout>` (not editable, no extras), then check that
# numpy is absent and that `dscore run --num_gpus 2 tests/integration/no_numpy_job.py` (initialize, steps at
# ZeRO 0 and 3, save_checkpoint, load_checkpoint) exits 0 with both ranks' reports consistent.
# .ci/run runs it after `make test`. Everything lives in a temp dir removed at exit; the checkout is copied
# there first (its tracked and untracked, not ignored, files) so the build writes nothing into it.
# Env: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0), KEEP=1 keeps the temp dir.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
work=$(mktemp -d "${TMPDIR:-/tmp}/dscore-clean-install.XXXXXX")
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "clean_install_check: kept $work" >&2; else rm -rf "$work"; fi; }
trap cleanup EXIT
start=$(date +%s)
step() { echo "clean_install_check: [$(( $(date +%s) - start )) s] $*" >&2; }

step "copying the checkout to $work/src"
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | tar -C "$repo" --null -T - -cf - | tar -C "$work/src" -xf -

step "making a venv with $python (no system site packages)"
"$python" -m venv "$work/venv"
V=$work/venv/bin
"$V/python" -m pip install -q "$torch_spec"
step "pip install $torch_spec done"
"$V/python" -m pip install -q "$work/src"
step "pip install . done"

if "$V/python" -c "import numpy" 2>/dev/null; then
    echo "clean_install_check: numpy is installed in the clean venv ($("$V/python" -m pip show numpy 2>/dev/null |
        grep -i '^required-by' || true)); the check needs a venv without it" >&2
    exit 1
fi

out=$work/out
mkdir "$out"
port=$("$V/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "dscore run --num_gpus 2 (port $port)"
# from the temp dir, so imports come from the venv, never from a source tree
(cd "$work" && OMP_NUM_THREADS=1 "$V/dscore" run --num_gpus 2 --master_port "$port" \
    "$work/src/tests/integration/no_numpy_job.py" --out "$out")

"$V/python" - "$out" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
problems = []
for r, rep in enumerate(ranks):
    if rep["numpy_imported"]:
        problems.append(f"rank {r} imported numpy")
    for stage in ("0", "3"):
        s = rep["stages"][stage]
        if s["loaded"] != s["saved"]:
            problems.append(f"rank {r} stage {stage}: loaded {s['loaded']} != saved {s['saved']}")
        if s["client"] != {"stage": int(stage)}:
            problems.append(f"rank {r} stage {stage}: client state {s['client']}")
for stage in ("0", "3"):
    if ranks[0]["stages"][stage]["saved"] != ranks[1]["stages"][stage]["saved"]:
        problems.append(f"stage {stage}: the ranks' parameters differ")
if ranks[0]["stages"]["0"]["losses"] != ranks[0]["stages"]["3"]["losses"]:
    problems.append("ZeRO 0 and ZeRO 3 losses differ on rank 0")
if problems:
    sys.exit("clean_install_check: " + "; ".join(problems))
EOF
step "OK: a venv with only torch and dscore (no numpy) trained, saved and loaded on 2 ranks"
