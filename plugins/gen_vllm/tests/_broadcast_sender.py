"""The trainer side of the non-colocated refit test, run as its own process.

Holds a port for the weight broadcast group's store and prints it (one JSON line), builds the
FSDP2 backend (1 rank, gloo) from a Hugging Face checkpoint, joins the group as rank 0 and
streams ``backend.export_weights()`` to the engine's worker. Prints one JSON line with what was sent.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--chunk-bytes", type=int, default=64 << 10)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from rlcore.config.schema import PolicyConfig, RunConfig
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig
    from rlcore_vllm.broadcast import WeightGroup, reserve_listener

    port = reserve_listener(args.host)
    print(json.dumps({"port": port}), flush=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port needed
    config = RunConfig(policy=PolicyConfig(model_name=args.model_dir, precision="float32"), sections={SECTION: DTensorConfig()})
    backend = FSDP2Backend(config, DTensorConfig(), WorldInfo())
    group = WeightGroup(args.host, port, args.world_size, 0, "gloo", timeout_s=120.0)
    sent = group.send(backend.export_weights(dtype=torch.float32, chunk_bytes=args.chunk_bytes))
    print(json.dumps(sent), flush=True)
    group.close()
    backend.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
