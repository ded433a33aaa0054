#!/usr/bin/env bash
# Here (a machine that reaches PyPI), in the repository root: stage everything the H200 machines
# lack as cp312 wheels in .gpu/chunk-N (<= 60 MiB each, shared/gpu/stage.py) and build rlcore's
# own six wheels into .gpu/own; the chunks go to the device as the pieces in .gpu/t/NN. Then follow
# benchmarks/gpu/README.md.
#   bash benchmarks/gpu/prepare.sh          # everything: Transformer Engine, megatron-core, vLLM, Ray, math-verify
#   bash benchmarks/gpu/prepare.sh train    # training benchmarks and CUDA tests only: Transformer Engine, megatron-core
set -euo pipefail
cd "$(dirname "$0")/../.."
# Transformer Engine 2.20.2: its torch extension built from the sdist for torch 2.11 (no binary on the index), the CUDA 13
# core library, and the pins they need. Exact versions first: stage.py keeps the first spec per name.
TE=(../shared/gpu/wheels/transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl
    transformer-engine-cu13==2.20.2 transformer-engine==2.20.2 nvidia-cudnn-frontend==1.32.0)
case "${1:-all}" in
  train) python3 ../shared/gpu/stage.py "${TE[@]}" megatron-core==0.16.1 ;;
  # apache-tvm-ffi: vLLM 0.26.0 with xgrammar 0.2.1 pins 0.1.10; cudnn-frontend asks for >= 0.1.11, but TE uses
  # tvm-ffi only for optional CuTeDSL kernels and falls back to its CUDA C++ ones without them.
  all) python3 ../shared/gpu/stage.py apache-tvm-ffi==0.1.10 xgrammar==0.2.1 vllm==0.26.0 pycountry "${TE[@]}" \
         megatron-core==0.16.1 ray==2.60.0 math-verify==0.9.0 ;;
  *) echo "usage: $0 [all|train]" >&2; exit 2 ;;
esac
rm -rf .gpu/own && mkdir -p .gpu/own
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/own \
    ./core ./plugins/backend_fsdp2 ./plugins/backend_megatron ./plugins/gen_vllm ./plugins/gen_sglang ./plugins/env_math
# A call carries at most 64 MiB with the checkout's tracked files (7.7 MB on 2026-12-03; 57 MiB pieces
# stopped fitting then): one tar of the chunks, cut into 50 MiB pieces, one per .gpu/t/NN, which the
# device calls carry one at a time.
rm -rf .gpu/t && mkdir -p .gpu/t
tar cf - -C .gpu $(cd .gpu && ls -d chunk-*) | split -b 50M -d -a 2 - .gpu/t/p.
for piece in .gpu/t/p.*; do mkdir -p ".gpu/t/${piece##*.}" && mv "$piece" ".gpu/t/${piece##*.}/"; done
ls .gpu .gpu/t
