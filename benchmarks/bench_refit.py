"""Colocated refit time and GB/s of the rlcore vLLM generator, for the 1.2B and 8B Llama shapes.

The "trainer" holds every Hugging Face-named tensor in bf16 on the same GPU (random values);
``ColocatedTransport`` streams them in ``--chunk-mb`` chunks into the engine through
``update_weights`` (vLLM layer-wise reload in the worker). With the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default here) tensors are handed over directly;
``--engine-process`` runs the engine core in its own process and sends CUDA IPC handles instead.
One warm-up refit, then ``--repeats`` timed ones (median). Also times ``sleep()``/``wake_up()``.
Prints one JSON line per shape.

    python benchmarks/bench_refit.py                   # GPU: 1.2b and 8b
    python benchmarks/bench_refit.py --tiny            # CPU check (shared-memory path)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path



class RandomTrainer:
    """Exports fixed random HF-named tensors in byte-bounded chunks (a backend's ``export_weights``)."""

    def __init__(self, named_shapes, dtype, device):
        import torch

        g = torch.Generator(device=device).manual_seed(0)
        self.tensors = [(n, (torch.randn(s, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype))
                        for n, s in named_shapes]

    def export_weights(self, dtype=None, chunk_bytes: int = 1 << 30):
        from rlcore.training.weights import chunked

        yield from chunked(self.tensors, chunk_bytes)


def run_shape(args) -> dict:
    import torch

    from rlcore_vllm.benchmarking import config_only_model, gpu_env_defaults, has_cuda, hf_named_shapes

    cuda = has_cuda()
    if cuda:
        gpu_env_defaults()
    if args.engine_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from rlcore.interfaces import SamplingParams
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator
    from rlcore_vllm.transport import ColocatedTransport

    dtype_name = "bfloat16" if cuda else "float32"
    device = "cuda" if cuda else "cpu"
    model_dir = config_only_model(Path(args.workdir) / args.shape, args.shape, dtype_name, max_positions=1024)
    cfg = VllmConfig(enforce_eager=True, gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_space_gib=0.25,
                     max_num_seqs=16)
    gen = VllmGenerator(str(model_dir), cfg, max_model_len=512, dtype=dtype_name, seed=0, device=device,
                        engine_kwargs={"load_format": "dummy"})
    from rlcore.runtime import LocalTrainer

    trainer = LocalTrainer(RandomTrainer(hf_named_shapes(model_dir), getattr(torch, dtype_name), device))
    probe = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = gen.generate([[5, 6, 7, 8]], probe)[0][0].response_ids
    transport = ColocatedTransport(chunk_bytes=args.chunk_mb << 20)
    moved = transport.transfer(trainer, gen)  # warm-up
    after = gen.generate([[5, 6, 7, 8]], probe)[0][0].response_ids
    times = []
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize()
        times.append(transport.transfer(trainer, gen)["seconds"])
    sleep_s = wake_s = None
    if cuda:
        t0 = time.perf_counter()
        gen.sleep()
        sleep_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen.wake_up()
        wake_s = time.perf_counter() - t0
    encoding = gen.encoding_for(trainer.tensors[0][1])
    gen.shutdown()
    seconds = statistics.median(times)
    return {"bench": "refit_colocated", "shape": args.shape, "device": device, "encoding": encoding,
            "bytes": int(moved["bytes"]), "chunk_mb": args.chunk_mb, "first_refit_s": round(moved["seconds"], 4),
            "seconds_median": round(seconds, 4), "gb_per_s": round(moved["bytes"] / seconds / 1e9, 2),
            "outputs_changed": before != after, "sleep_s": sleep_s and round(sleep_s, 3),
            "wake_up_s": wake_s and round(wake_s, 3), "repeats": args.repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU check with a tiny model")
    parser.add_argument("--shapes", default=None, help="comma-separated: 1.2b,8b,tiny")
    parser.add_argument("--chunk-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--engine-process", action="store_true", help="engine core in its own process (CUDA IPC / shm)")
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.shapes, args.repeats, args.chunk_mb = args.shapes or "tiny", min(args.repeats, 3), min(args.chunk_mb, 1)
    if args.shape:
        args.workdir = args.workdir or tempfile.mkdtemp(prefix="rlcore-bench-refit-")
        print(json.dumps(run_shape(args)), flush=True)
        return
    for shape in (args.shapes or "1.2b,8b").split(","):  # a fresh process (and engine) per shape
        argv = [a for a in sys.argv[1:] if not a.startswith("--shapes")]
        if "--shapes" in sys.argv:
            i = sys.argv.index("--shapes")
            argv = sys.argv[1:i] + sys.argv[i + 2:]
        subprocess.run([sys.executable, __file__, *argv, "--shape", shape,
                        "--chunk-mb", str(args.chunk_mb), "--repeats", str(args.repeats)], check=True)


if __name__ == "__main__":
    main()
