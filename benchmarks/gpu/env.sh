#!/usr/bin/env bash
# On the GPU machine, in a later call on the same warm machine (install.sh ran before): the
# environment that install.sh exports. Source it: `source benchmarks/gpu/env.sh`.
export PYTHONPATH=$PWD/core/src:$PWD/plugins/backend_megatron/src:$PWD/plugins/backend_fsdp2/src:$PWD/plugins/gen_vllm/src:$PWD/plugins/gen_sglang/src:$PWD/plugins/env_math/src:/tmp/site:${PYTHONPATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# Transformer Engine loads cuDNN from the system before Python's packages; on an image with both, the system's
# sub-libraries bind to the ones torch loaded from its package and TE fails to load ("libcudnn_heuristic.so.9:
# undefined symbol ... libcudnn_graph.so.9"), in a process that used cuDNN before importing TE. CUDNN_PATH
# points TE at torch's cuDNN, and the loader's path makes its sub-libraries come from there too.
CUDNN_PATH=${CUDNN_PATH:-$(python3 -c 'import nvidia.cudnn as m; print(m.__path__[0])' 2>/dev/null)}
if [ -n "$CUDNN_PATH" ]; then export CUDNN_PATH LD_LIBRARY_PATH=$CUDNN_PATH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
