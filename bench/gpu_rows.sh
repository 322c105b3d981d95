#!/bin/bash
# The GPU rows the open issues still need, in one command on a one-GPU machine (H100 or H200), each with its
# torch/inductor baseline in the same run: bash bench/gpu_rows.sh [GROUP...]  (default: every group, in order;
# about 25 minutes in all, so on a machine with a 10-minute limit per command run two or three groups per call)
#
# Groups (each step has its own time limit, so one slow row cannot eat the rest):
#   cuda    the CUDA tests first: the eager suite on CUDA worker threads (the native lanes' stream waits; alone:
#           cuda-eager) and the GPU-marked tests of the executor, cluster and compile backend (cuda-marked)
#   train   issue 24: compiled training (time and peak memory, after the donation of saved activations),
#           eager training, the simulated tp2 / dp2 modes
#   e2e     issue 20: a small CUDA op end to end (worker overhead over torch, thread and process mode)
#   llama   issue 23: 8-layer Llama-3-8B decode, eager and compiled, batch 1 (alone: llama-eager, llama-compile)
#   sd3     issues 21 / 22: SD3-medium compiled with CUDA graphs, then fp8 + fused ops + a 50 % skip cache
#
# Wheels the machine lacks (pyzmq, diffusers with importlib_metadata and zipp, expecttest) are installed from .whl/
# when that folder exists (docs/building.md, "GPU machine"). The log goes to $OUT/log.txt when OUT is set.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
LOG=${OUT:-/tmp}/log.txt
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

step() {  # step SECONDS command...: run with a time limit, log the output and the exit status
  local t=$1
  shift
  echo "=== [$(date +%T)] $*" | tee -a "$LOG"
  timeout "$t" "$@" 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG" > /dev/null
  echo "--- rc=${PIPESTATUS[0]} [$(date +%T)]" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$LOG"
# the native fast path and worker loop, built once (~65 s on a fresh machine)
step 150 python3 -c "from torch_dtorch.device import native; from torch_dtorch.runtime import native_replay; \
native.load(); native_replay.extension()"

groups=${*:-cuda train e2e llama sd3}
for g in $groups; do
  case $g in
    cuda|cuda-eager)
      step 300 env DTORCH_TEST_DEVICE=cuda python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/eager
      ;;&
    cuda|cuda-marked)
      step 200 python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/executor tests/cluster tests/backend \
        tests/training tests/collectives
      ;;
    train)
      step 90 python3 -m pytest -q -p no:cacheprovider tests/training/test_donation.py
      step 150 python3 bench/train_gpu.py --modes inductor dtorch-compiled --repeat 3 --warmup 2
      step 120 python3 bench/train_gpu.py --modes torch dtorch --repeat 3 --warmup 2
      step 150 python3 bench/train_gpu.py --modes dtorch-tp2 dtorch-compiled-tp2 dtorch-dp2 --repeat 2 --warmup 2
      ;;
    e2e)
      step 120 python3 bench/eager_e2e.py --device cuda --ops 1000 --repeat 3
      ;;
    llama|llama-eager)
      step 150 python3 bench/llama_gpu.py --variants torch-eager,dtorch-eager --layers 8 --prefill 512 \
        --decode 64 --batch 1 --repeats 2
      ;;&
    llama|llama-compile)
      step 240 python3 bench/llama_gpu.py --variants torch-compile,dtorch-compile --layers 8 --prefill 512 \
        --decode 64 --batch 1 --repeats 2
      ;;
    sd3)
      step 200 python3 bench/flux_gpu.py --model sd3 --modes inductor dtorch-compiled --steps 28 --repeat 2 \
        --cudagraphs
      step 240 python3 bench/flux_gpu.py --model sd3 --modes inductor dtorch-compiled --steps 28 --repeat 2 \
        --quant fp8 --fuse --cache-skip 0.5 --accelerated-only
      ;;
    cuda-eager|cuda-marked|llama-eager|llama-compile) ;;
    *)
      echo "unknown group $g (cuda, train, e2e, llama, sd3)" | tee -a "$LOG"
      ;;
  esac
done
