#!/usr/bin/env bash
# On the GPU machine, in a later call on the same warm machine (install.sh ran before): the
# environment that install.sh exports. Source it: `source benchmarks/gpu/env.sh`.
export PYTHONPATH=$PWD/core/src:$PWD/plugins/backend_megatron/src:$PWD/plugins/backend_fsdp2/src:$PWD/plugins/gen_vllm/src:$PWD/plugins/env_math/src:/tmp/site:${PYTHONPATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
