#!/usr/bin/env bash
# On the H200 machine, after every chunk was copied to /root/stage: install the staged wheels and
# rlcore's own into /tmp/site. Source it: `source benchmarks/gpu/install.sh`.
set -e
bash .gpu/install.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/own/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ATTENTION_BACKEND=FLASH_ATTN VLLM_HOST_IP=127.0.0.1 NCCL_NVLS_ENABLE=0
python3 -c "import rlcore, vllm, megatron.core, ray; print('rlcore', rlcore.__version__, 'vllm', vllm.__version__)"
