"""One rank of the 2-rank gloo run behind test_fsdp2_distributed.py.

``python _fsdp2_worker.py SPEC.json`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.
Runs every scenario in one process (process start and imports dominate on 2 cores), records each
scenario's outputs or its traceback, and saves ``rank{R}.pt`` into the spec's ``out`` directory;
the pytest side computes the single-process references and asserts.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from _fsdp2_common import algorithm, export, make_batch, run_config, with_logprob_fields


def build(model_dir: str, **kwargs):
    from rlcore.interfaces import WorldInfo
    from rlcore.plugins import get_plugin_manager
    from rlcore_fsdp2.config import SECTION

    config = run_config(model_dir, **kwargs)
    reg = get_plugin_manager().get("training_backend", "fsdp2")
    assert reg.section == SECTION
    world = WorldInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(), device="cpu")
    return reg.build(config, config.section(SECTION), world)


def bcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train_flow(backend, batch_seed: int):
    """Old and reference logprobs from the backend, then one train() call."""
    batch = make_batch(batch_seed)
    old = bcast(backend.logprobs(batch))
    ref = bcast(backend.logprobs(batch, reference=True))
    batch = with_logprob_fields(batch, old, ref, seed=batch_seed)
    metrics = backend.train(batch, algorithm())
    params, _ = export(backend)
    return {"batch": batch, "metrics": metrics, "params": params}


def scenario_arch(model_dir: str, train: bool, **kwargs):
    backend = build(model_dir, gbs=4, **kwargs)
    layer = backend.model.model.layers[0]
    layer = getattr(layer, "_checkpoint_wrapped_module", layer)
    out = {"logprobs": backend.logprobs(make_batch(1)),
           "placements": {name: [str(p) for p in getattr(param, "placements", ())]
                          for name, param in layer.named_parameters() if name.endswith("proj.weight")}}
    if train:
        out.update(train_flow(backend, 1))
    backend.shutdown()
    return out


def scenario_llama(model_dir: str, ckpt: str, hf_dir: str):
    backend = build(model_dir, gbs=4)
    batch1 = make_batch(1)
    out = {"logprobs": backend.logprobs(batch1)}
    out["step1"] = train_flow(backend, 1)
    out["ref_after_train"] = backend.logprobs(batch1, reference=True)
    before = backend.logprobs(batch1)
    backend.offload()
    backend.onload()
    out["offload"] = (before, backend.logprobs(batch1))
    _, out["chunk_sizes"] = export(backend, chunk_bytes=40_000)
    backend.save_checkpoint(ckpt)
    out["step2"] = train_flow(backend, 2)
    # A non-finite loss must skip the update and leave every parameter as it was.
    bad = out["step2"]["batch"]
    for i in (0, 4):  # one sequence in each optimizer step (train_global_batch_size 4)
        bad.token_fields["old_logprobs"][i][-1] = float("nan")
    out["nonfinite_metrics"] = backend.train(bad, algorithm())
    out["params_after_nonfinite"], _ = export(backend)
    out["probe_logprobs"] = backend.logprobs(make_batch(3))
    backend.export_hf(hf_dir)
    backend.shutdown()
    return out


def scenario_release(model_dir: str):
    """offload/onload round trips (weights kept for a refit, then released too) between two training steps, beside
    a backend that never releases: every state tensor bitwise equal after each trip, its storage empty while out,
    and the next step the same to the bit."""
    from rlcore.testing.offload import release_round_trips
    from rlcore_fsdp2.weights import local, state_tensors

    released, plain = build(model_dir, gbs=4), build(model_dir, gbs=4)
    train_flow(released, 1), train_flow(plain, 1)
    out = release_round_trips(released, lambda: state_tensors(released.model, released.optimizer),
                              lambda: [local(p) for p in released.model.parameters()])
    a, b = train_flow(released, 2), train_flow(plain, 2)
    out["loss_equal"] = a["metrics"]["loss"] == b["metrics"]["loss"]
    out["params_equal"] = all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])
    out["state_equal"] = all(torch.equal(x, y) for x, y in zip(state_tensors(released.model, released.optimizer),
                                                                state_tensors(plain.model, plain.optimizer)))
    released.shutdown(), plain.shutdown()
    return out


def scenario_resume(model_dir: str, ckpt: str):
    backend = build(model_dir, gbs=4)
    backend.load_checkpoint(ckpt)
    out = {"step2": train_flow(backend, 2), "step": backend.step}
    # One sequence for two data-parallel ranks: rank 1 runs an empty (padding-only) micro-batch.
    from rlcore.plugins import get_plugin_manager

    sft = get_plugin_manager().get("algorithm", "sft")
    single = make_batch(5, n=1)
    out["single_logprobs"] = backend.logprobs(single)
    out["single_metrics"] = backend.train(single, sft.build(sft.config_cls()))
    backend.shutdown()
    return out


def expect_error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return None


def scenario_errors(spec):
    return {
        "mesh": expect_error(lambda: build(spec["llama"], tensor_parallel_size=3)),
        "heads": expect_error(lambda: build(spec["llama"], tensor_parallel_size=2)),  # 1 kv head
        "arch": expect_error(lambda: build(spec["gpt2"])),
        "shape": expect_error(lambda: build(spec["llama_other"]).load_checkpoint(spec["ckpt"])),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    results, timings = {}, {}

    def run(name, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            results[name] = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - recorded; the test names the scenario
            results[name] = {"error": traceback.format_exc()}
        timings[name] = time.perf_counter() - start
        dist.barrier()

    run("llama", scenario_llama, spec["llama"], spec["ckpt"], spec["hf_out"])
    run("resume", scenario_resume, spec["llama"], spec["ckpt"])
    run("release", scenario_release, spec["llama"])
    run("qwen2", scenario_arch, spec["qwen2"], False)
    run("qwen3", scenario_arch, spec["qwen3"], True)
    run("qwen3_tp", scenario_arch, spec["qwen3"], True, tensor_parallel_size=2, sequence_parallel=True,
        activation_checkpointing=True)
    run("qwen3_tp_plain", scenario_arch, spec["qwen3"], True, tensor_parallel_size=2,
        custom_parallel_plan="_fsdp2_common:attention_only_plan")
    run("qwen3_moe", scenario_arch, spec["qwen3_moe"], True)
    # Gradients reduced once per step (not per micro-batch), gathered params kept between passes.
    run("qwen3_deferred", scenario_arch, spec["qwen3"], True, defer_grad_sync=True, reshard_after_forward=False)
    run("qwen3_moe_tp", scenario_arch, spec["qwen3_moe"], True, tensor_parallel_size=2, sequence_parallel=True,
        packing=False)
    run("qwen2_tied_tp", scenario_arch, spec["qwen2_tied"], True, tensor_parallel_size=2, sequence_parallel=True)
    run("errors", scenario_errors, spec)
    results["timings"] = timings
    torch.save(results, Path(spec["out"]) / f"rank{dist.get_rank()}.pt")
    dist.barrier()  # gloo torn down while the other rank still talks to it can abort ("terminate called...")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
