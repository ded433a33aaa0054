#!/usr/bin/env bash
# On the GPU machine, after every chunk was copied to /root/stage: install the staged wheels and
# rlcore's own into /tmp/site. Source it: `source benchmarks/gpu/install.sh`. The checkout's
# sources go first on PYTHONPATH (the installed wheels provide the entry points), so the code that
# travelled with this call is the code that runs. No `set -e`: it would stay on in the caller's
# shell, and one failed job (benchmarks/gpu/jobs.sh) would end the whole call.
bash .gpu/install.sh || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/own/*.whl || return 1
source benchmarks/gpu/env.sh
python3 - <<'PY'
import importlib
for name in ("rlcore", "megatron.core", "transformer_engine.pytorch", "vllm", "ray"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'ok')}")
    except Exception as exc:  # noqa: BLE001 - report what this call can use
        print(f"{name}: not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
PY
