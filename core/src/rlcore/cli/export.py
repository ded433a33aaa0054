"""``rlcore export CHECKPOINT OUT``: an rlcore checkpoint as a Hugging Face model directory.

``CHECKPOINT`` is a step directory (``<log_dir>/checkpoints/step_000040``), a checkpoints root
(its newest complete step is taken) or a run directory (``logger.log_dir``: its checkpoints
root). The run's resolved config says which backend wrote it and from which model: the copy
the checkpoint's loop state carries, or (checkpoints of older versions) the ``config.yaml`` two
levels up, in the run directory that holds it. A path named inside the checkpoint is never
followed: a copied or crafted checkpoint cannot make export read another run's files, and a
symbolic link in what is exported that points outside it (``model/notes.txt -> /etc/passwd``)
stops the export before anything is copied (:mod:`rlcore.config.run_paths`). The output is written
beside ``OUT`` and renamed into place when complete: a failed export (a full disk) leaves no part.
The backend plugin that wrote the checkpoint reads its model part in this one process
(:func:`rlcore.hookspecs.rlcore_export_checkpoint`), whatever TP/PP/EP layout it was saved
with, and writes safetensors, ``config.json`` and the tokenizer.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from rlcore.config import ConfigError, RunConfig
from rlcore.loading.loader import build_config
from rlcore.loading.loader import read_recipe_yaml, upgrade_saved_config
from rlcore.controller.checkpoint import CheckpointManager
from rlcore.controller.run_end import MODEL_DIR
from rlcore.errors import CheckpointError
from rlcore.config.run_paths import refuse_unsafe_links, replace_dir, settle_leftovers, tree_bytes

RUN_CONFIG = "config.yaml"


def is_hf_model_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def final_model(path: str | Path) -> Path | None:
    """``<run dir>/model``, the final model a run writes, when ``path`` is a run directory that
    holds no checkpoint (a run with checkpoints exports from its newest, as before)."""
    path = Path(path).expanduser()
    if is_hf_model_dir(path / MODEL_DIR) and CheckpointManager(path / "checkpoints", keep_last_k=1).latest() is None \
            and not (path / "loop_state.pt").is_file():
        return path / MODEL_DIR
    return None


def find_checkpoint(path: str | Path) -> Path:
    """The complete step directory ``path`` names (itself, the newest under it, or the newest
    under its ``checkpoints/``)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if (path / "loop_state.pt").is_file():
        return path
    if re.search(r"\.tmp(\.|$)", path.name):
        raise CheckpointError(f"{path} is an unfinished checkpoint (its save never completed); use a complete step_N")
    for root in (path, path / "checkpoints"):
        latest = CheckpointManager(root, keep_last_k=1).latest()
        if latest is not None:
            return latest
    raise CheckpointError(f"{path} holds no complete rlcore checkpoint (a step_N directory with loop_state.pt, "
                          "or a run directory whose checkpoints/ has one). " + HOW_TO_GET_ONE)


HOW_TO_GET_ONE = ("Every run writes its final model to <logger.log_dir>/model (a Hugging Face directory that "
                  "rlcore eval and transformers read as it is); checkpoints come with checkpointing.enabled=true "
                  "(every checkpointing.save_period steps and at the last step), e.g. rlcore run RECIPE "
                  "checkpointing.enabled=true")


def run_config_for(step_dir: Path, overrides: list[str] = ()) -> RunConfig:
    """The config of the run that wrote ``step_dir`` (with ``overrides``, e.g. a moved ``policy.model_name``)."""
    try:
        carried = (CheckpointManager.load_loop_state(step_dir).get("run") or {}).get("config")
    except Exception as exc:  # noqa: BLE001 - a damaged loop state still leaves the run directory to try
        print(f"warning: {step_dir / 'loop_state.pt'} does not load ({exc}); looking for the run's config beside it", flush=True)
        carried = None
    if isinstance(carried, str):
        try:
            data = yaml.safe_load(carried)
        except yaml.YAMLError as exc:
            raise CheckpointError(f"{step_dir / 'loop_state.pt'}: the run config it carries is not valid YAML ({exc})") from None
        return _saved_run_config(data, overrides, f"{step_dir / 'loop_state.pt'}: the run config it carries",
                                 f"the run config carried by {step_dir}")
    beside = step_dir.parent.parent / RUN_CONFIG
    if beside.is_file():
        return _saved_run_config(read_recipe_yaml(beside), overrides, f"{beside}: the run config", f"in {beside}")
    raise CheckpointError(f"the run config of {step_dir} was not found: its loop state carries none (written by an older "
                          f"rlcore) and there is no {beside}; copy the run's config.yaml there")


def _saved_run_config(data: Any, overrides: list[str], what: str, where: str) -> RunConfig:
    """A run's saved config (``data``, parsed YAML) as a RunConfig, its moved keys upgraded; errors name ``where``."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} is not a mapping")
    try:
        return build_config(upgrade_saved_config(data), list(overrides))
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{exc.message} ({where})") from exc


def check_writable_target(out: Path) -> None:
    """``out`` must be an empty (or new) directory this process can write, checked before any work."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("", f"export target {out} already exists and is not an empty directory; choose another OUT")
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".rlcore-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("", f"export target {out} cannot be written ({exc.strerror or exc}); choose a writable OUT") from None
    finally:
        if not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def _write_out(out: Path, write, needed_bytes: int) -> None:
    replace_dir(out, write, "the export", needed_bytes, fix="choose an OUT on a larger disk")


def export_checkpoint(checkpoint: str | Path, out: str | Path, overrides: list[str] = ()) -> dict:
    """Write the checkpoint's policy to ``out`` (which must not hold files yet); returns what was done."""
    from rlcore.controller.model_files import check_model_name
    from rlcore.controller.engines import select_backend
    from rlcore.plugins import get_plugin_manager

    out = Path(out).expanduser()
    check_writable_target(out)
    checkpoint = Path(checkpoint).expanduser()
    if checkpoint.exists():  # the path typed is followed; links found inside it are not
        checkpoint = checkpoint.resolve()
    if checkpoint.is_dir():  # a run directory: its final model's swap that a kill cut short is completed first
        settle_leftovers(checkpoint, [MODEL_DIR])
    final = final_model(checkpoint)
    if final is not None:  # a run without checkpoints: its final model is already in Hugging Face format
        refuse_unsafe_links(final, checkpoint, f"export of {final}")
        _write_out(out, lambda tmp: shutil.copytree(final, tmp), tree_bytes(final))
        return {"checkpoint": str(final), "backend": "final model", "out": str(out), "model_name": str(final),
                "precision": "as saved"}
    step_dir = find_checkpoint(checkpoint)
    refuse_unsafe_links(step_dir, checkpoint, f"export of {step_dir}")  # the run or step directory typed
    config = run_config_for(step_dir, overrides)
    check_model_name(config)  # its config.json and tokenizer are the export's; moved? override policy.model_name
    manager = get_plugin_manager()
    backend = select_backend(config, manager).name

    def write(tmp: Path) -> None:
        written = manager.export_checkpoint(backend, step_dir / "backend", config, tmp)
        if written is None:
            raise CheckpointError(f"no installed plugin exports checkpoints of the '{backend}' backend ({step_dir})")
        if not is_hf_model_dir(tmp):
            raise CheckpointError(f"the {backend} backend's export of {step_dir} wrote no Hugging Face model to {out}")

    _write_out(out, write, 0)
    return {"checkpoint": str(step_dir), "backend": backend, "out": str(out), "model_name": config.policy.model_name,
            "precision": config.policy.precision}
