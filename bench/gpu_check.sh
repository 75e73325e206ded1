#!/usr/bin/env bash
# GPU checks for a lent CUDA machine (run from the repo root). The machine has its own torch;
# the project's pure-Python dependencies it lacks travel as wheels in .whl/ (see README "GPU").
# Usage: bash bench/gpu_check.sh [smoke|sweep]   — logs go to $OUT (or ./gpu_out).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTBENCH_CACHE_DIR=/tmp/optbench-cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
mode=${1:-smoke}
if [ "$mode" = sweep ]; then
  # The plan's phases on the GPU (compile, checkpointing, loss_freq, dataloader, torchao CPU offload,
  # bf16; the FSDP2 phases need 2 GPUs), then FlexAttention + fused AdamW on top of phase 6 alone,
  # then the CUDA-only tests. Everything lands in $OUT as at most 8 files (runs.tgz holds the runs).
  W=/tmp/gpu; mkdir -p $W
  echo "=== sweep"; date
  timeout 330 python3 -m optbench train -m 'phase=glob(*)' model=base train.steps=20 train.progress=log \
    hydra.sweep.dir=$W/sweep > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
  grep -E "^(optbench run|  (error|applied|loss  |step time|throughput|memory))|Launching|#[0-9]+ :" "$OUT/sweep.log" | head -90
  echo "=== flex"; date
  timeout 120 python3 -m optbench train phase=6_bf16 attention=flex optimizer=adamw_fused model=base \
    train.steps=20 train.progress=log hydra.run.dir=$W/flex > "$OUT/flex.log" 2>&1; echo "flex rc=$?"
  sed -n '/^optbench run/,$p' "$OUT/flex.log"
  echo "=== pytest (CUDA-only tests)"; date
  timeout 150 python3 -m pytest -q --timeout=100 -p no:cacheprovider tests/test_cuda.py \
    tests/test_cuda_optimizations.py tests/test_parallel_cuda.py tests/test_estimate_cuda.py 2>&1 \
    | tail -30 > "$OUT/pytest.txt"; cat "$OUT/pytest.txt"
  tar -C $W --exclude='*.distcp' -czf "$OUT/runs.tgz" . ; ls -la "$OUT"; date
  exit 0
fi
run() {  # name, overrides...
  local name=$1; shift
  echo "=== $name: $*"
  timeout 300 python3 -m optbench train "$@" train.progress=log hydra.run.dir="$OUT/runs/$name" > "$OUT/$name.log" 2>&1
  echo "rc=$?"; sed -n '/^optbench run/,$p' "$OUT/$name.log"
}
run base_fp32 model=base precision=fp32 train.steps=20 train.batch_size=8 train.seq_len=1024
run base_tf32 model=base precision=tf32 train.steps=20 train.batch_size=8 train.seq_len=1024
run base_bf16 model=base precision=bf16 train.steps=20 train.batch_size=8 train.seq_len=1024
run base_fp16 model=base precision=fp16 train.steps=20 train.batch_size=8 train.seq_len=1024
run base_bf16_ac model=base precision=bf16 checkpointing=full train.steps=20 train.batch_size=8 train.seq_len=1024
echo "=== pytest (CUDA visible)"
timeout 300 python3 -m pytest -q --timeout=120 -p no:cacheprovider tests 2>&1 | tail -25 | tee "$OUT/pytest.txt"
