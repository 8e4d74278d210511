#!/usr/bin/env bash
# The GPU rows of issue 33, in one call of the device tool (a machine with a GPU, lent to some
# tasks only; its python3 holds a CUDA torch and nothing of ours is installed there):
#
#   run(command="bash benchmarks/gpu.sh", timeout_s=540)
#
# Everything it needs travels with the working tree (preemptible imports none of its
# dependencies on this path). What it prints comes back in $OUT, one file per benchmark.
# On the CPU machines it runs too, with the state in host memory only where torch sees no GPU,
# to try it before spending device time: `SIZES=50 REPEATS=1 bash benchmarks/gpu.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
read -r -a sizes <<<"${SIZES:-1000 2000}"
repeats=${REPEATS:-3}
"$py" -c 'import torch; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())' \
    | tee "$out/machine.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$out/machine.txt" 2>&1
df -T /tmp /dev/shm >>"$out/machine.txt" 2>&1
device=cpu
"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' && device=cuda
# 1. the async stall over a pinned device-to-host copy, the sync save over the raw write, the
# stop's save and signal -> gone: state on the GPU, checkpoints on the local disk
timeout 360 "$py" benchmarks/bench_checkpoint_cost.py --device "$device" --sizes "${sizes[@]}" \
    --repeats "$repeats" >"$out/cost-$device.txt" 2>"$out/cost-$device.err"
echo "bench_checkpoint_cost --device $device: exit $?" | tee -a "$out/machine.txt"
# 2. the same with the state in host memory, side by side on the same machine
timeout 200 "$py" benchmarks/bench_checkpoint_cost.py --device cpu --sizes "${sizes[@]}" \
    --repeats "$repeats" >"$out/cost-cpu.txt" 2>"$out/cost-cpu.err"
echo "bench_checkpoint_cost --device cpu: exit $?" | tee -a "$out/machine.txt"
cat "$out"/cost-*.txt
