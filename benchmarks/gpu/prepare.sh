#!/usr/bin/env bash
# Here (a machine that reaches PyPI), in the repository root: stage everything the H200 machines
# lack as cp312 wheels in .gpu/chunk-N (<= 60 MiB each, shared/gpu/stage.py) and build rlcore's
# own five wheels into .gpu/own. Then follow benchmarks/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 ../shared/gpu/stage.py vllm==0.26.0 xgrammar==0.2.1 apache-tvm-ffi==0.1.10 pycountry \
    megatron-core==0.16.1 ray==2.60.0 math-verify==0.9.0
rm -rf .gpu/own && mkdir -p .gpu/own
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/own \
    ./core ./plugins/backend_fsdp2 ./plugins/backend_megatron ./plugins/gen_vllm ./plugins/env_math
ls .gpu
