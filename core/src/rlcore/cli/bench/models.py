"""Random-init models of a recipe's model configuration, for benchmarks (nothing is downloaded).

The shape comes from the recipe's ``policy.model_name``: a local model directory gives its own
``config.json`` (a vision-language one too: its tokenizer, processor and chat template are kept); a
known hub name, or ``--shape``, gives a shape of :data:`SHAPES`. The model is
built with transformers' own initialisation (real sizes in bf16, on the GPU when there is one: an
8B model initialised on the host takes minutes) in a child process, so that the benchmark's process
holds no GPU memory before the run places its trainer and engine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from rlcore.planning.bench_shapes import SHAPES  # the widths of each benchmark model (the planner reads them too)

SMALL = ("demo", "tiny")  # float32, built in this process
# Hub names (lower case, a part of the name is enough) -> shape.
KNOWN_MODELS = {
    "runs/demo/sft": "demo",
    "llama-3.2-1b": "llama1b",
    "llama-3.2-3b": "llama3b",
    "llama-3.1-8b": "llama8b",
    "llama-3-8b": "llama8b",
}
WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
INFO = "rlcore_bench.json"  # beside the weights: the shape and the parameter count


def shape_of(model_name: str, shape: str | None = None) -> str | None:
    """The shape to build for ``model_name`` (None: a local directory, whose own config is used)."""
    if shape is not None:
        if shape not in SHAPES:
            raise SystemExit(f"--shape {shape!r}: known shapes are {', '.join(SHAPES)}")
        return shape
    if (Path(model_name) / "config.json").is_file():
        return None
    name = model_name.lower()
    for known, found in KNOWN_MODELS.items():
        if known in name:
            return found
    raise SystemExit(f"policy.model_name {model_name!r}: not a local model directory and not a known model name "
                     f"({', '.join(KNOWN_MODELS)}); pass --shape ({', '.join(SHAPES)})")


def llama_params(shape: dict) -> int:
    """Parameters of a Llama of ``shape`` (untied embeddings)."""
    h, layers, vocab, inter = shape["hidden_size"], shape["num_layers"], shape["vocab_size"], shape["intermediate_size"]
    kv = h * shape["num_kv_heads"] // shape["num_heads"]
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * inter + 2 * h
    return layers * per_layer + 2 * vocab * h + h


def build_model(model_name: str, root: Path, shape: str | None = None, gpu: bool = False) -> Path:
    """The random-init model directory for ``model_name`` under ``root`` (built once, then reused)."""
    shape = shape_of(model_name, shape)
    path = root / f"model-{shape or Path(model_name).name}"
    if (path / INFO).is_file() or (shape is not None and (path / "config.json").is_file()):
        return path  # built before (a shape's directory may come from benchmarks/bench_grpo_step.py)
    if shape in SMALL or not gpu:
        build_here(model_name, shape, path, device=None)
    else:
        subprocess.run([sys.executable, "-m", "rlcore.cli.bench.models", model_name, shape or "", str(path), "cuda"], check=True)
    return path


def build_here(model_name: str, shape: str | None, path: Path, device: str | None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rlcore.testing.tiny import build_tiny_model, build_tokenizer

    if shape is not None:
        kwargs = dict(SHAPES[shape])
        small = shape in SMALL
        build_tiny_model(path, "llama", dtype="float32" if small else "bfloat16", init_std=0.05 if small else None,
                         device=device, **kwargs)
        build_tokenizer(kwargs["vocab_size"]).save_pretrained(path)
        params = llama_params(kwargs)
    else:  # a local directory: its config, new weights, and its other files (tokenizer, processor, template)
        config = AutoConfig.from_pretrained(model_name)
        auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
        torch.manual_seed(0)
        with torch.device(device or "cpu"):
            model = auto.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
        model.save_pretrained(path, safe_serialization=True)
        for source in Path(model_name).iterdir():  # the weights (and their index) are the new ones
            if source.is_file() and not (path / source.name).exists() and not source.name.endswith(WEIGHT_FILES):
                shutil.copy2(source, path / source.name)
        params = sum(p.numel() for p in model.parameters())
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)  # a vision-language model's language part
    info = {"shape": shape or model_name, "params": int(params), "num_layers": text["num_hidden_layers"],
            "hidden_size": text["hidden_size"]}
    (path / INFO).write_text(json.dumps(info))


def model_info(path: Path) -> dict:
    """Shape, parameter count, layers and hidden size of a model ``build_model`` made."""
    path = Path(path)
    if (path / INFO).is_file():
        return json.loads((path / INFO).read_text())
    config = json.loads((path / "config.json").read_text())  # a Llama-family directory built without the record
    shape = dict(hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                 num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                 intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"])
    return {"shape": path.name.removeprefix("model-"), "params": llama_params(shape), "num_layers": shape["num_layers"],
            "hidden_size": shape["hidden_size"]}


if __name__ == "__main__":  # the child process of build_model: python -m rlcore.cli.bench.models NAME SHAPE PATH DEVICE
    name, shape_arg, out, dev = sys.argv[1:5]
    shutil.rmtree(out, ignore_errors=True)
    build_here(name, shape_arg or None, Path(out), dev)
