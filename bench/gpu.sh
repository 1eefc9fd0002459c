#!/usr/bin/env bash
# Issue 15 item 7 on a CUDA machine, from the repository root: the CUDA tests, then the GPU benchmarks.
#
#   bash bench/gpu.sh [OUT_DIR] [PART...]      # parts: env tests multilora attention host (default: all)
#
# Each part's output goes to OUT_DIR/<part>.log (default ./gpu-results) and to the terminal. Python is
# $PYTHON (default python3), which needs torch with CUDA, transformers, peft, msgspec and pydantic.
# The multilora part is the acceptance's configuration: a Qwen2-0.5B-shaped model (24 layers) from a
# config, bf16 through the pool's loader, rank-16 LoRA on all linears, N runs in one pass against N = 1
# on the same tokens and against peft one adapter at a time, at 512 and 1,024 tokens per adapter.
set -uo pipefail
out=${1:-gpu-results}
shift || true
parts=("${@:-env tests multilora attention host}")
read -r -a parts <<<"${parts[*]}"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$out"
status=0

run() { # run PART COMMAND...: the command's output to the terminal and to OUT/PART.log
    local part=$1
    shift
    echo "== $part: $*" | tee -a "$out/$part.log"
    "$@" 2>&1 | tee -a "$out/$part.log" || status=1
}

for part in "${parts[@]}"; do
    case $part in
    env)
        run env nvidia-smi
        run env "$py" -c "import torch, transformers, peft; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), transformers.__version__, peft.__version__)"
        ;;
    tests)
        # --noconftest: the suite's conftest sets up the service's database, which these tests do not use.
        run tests "$py" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
            tests/trainer_core/test_cuda.py tests/trainer_core/test_lora.py tests/trainer_core/test_precision.py \
            tests/trainer_core/test_grad_guard.py tests/trainer_core/test_rms_norm.py
        ;;
    multilora)
        common=(--device cuda --dtype bf16 --preset qwen2-0.5b --seq-len 512 --warmup 3 --repeats 10)
        # 512 tokens per adapter at N = 8, 16, 32; 1,024 at N = 8, 16.
        run multilora "$py" -m bench.multilora "${common[@]}" --tokens 4096 --ns 1,8 --modes multi,peft,multi-loop
        run multilora "$py" -m bench.multilora "${common[@]}" --tokens 8192 --ns 1,8,16 --modes multi,peft \
            --no-memory
        run multilora "$py" -m bench.multilora "${common[@]}" --tokens 16384 --ns 1,16,32 --modes multi,peft \
            --no-memory
        ;;
    attention)
        # The dense-mask path (sdpa) only at 8k: its (L, L) mask is what the packed path removes.
        run attention "$py" -m bench.attention --device cuda --dtype bf16 --lengths 8192,16384 \
            --impls auto --layers 24 --threads 0 --warmup 2 --repeats 5
        run attention "$py" -m bench.attention --device cuda --dtype bf16 --lengths 8192 \
            --impls sdpa --parts model --layers 24 --threads 0 --warmup 2 --repeats 5
        ;;
    host)
        # The host-side work of a pool step beside forward/backward, and where a step's time goes.
        run host "$py" -m bench.optimizer_step --device cuda --runs 1,8 --repeats 10
        run host "$py" -m bench.grad_guard --device cuda --runs 1,8 --repeats 10
        run host "$py" -m bench.multilora --device cuda --dtype bf16 --preset qwen2-0.5b --seq-len 512 \
            --tokens 4096 --ns 1,8 --modes multi,peft --warmup 3 --repeats 5 --no-memory --profile
        ;;
    *)
        echo "unknown part $part (env tests multilora attention host)" >&2
        status=2
        ;;
    esac
done
exit $status
