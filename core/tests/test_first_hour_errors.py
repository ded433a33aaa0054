"""What a new user is told when a run stops early: Ctrl-C without checkpoints says what will work
(and doing it works), a model name that is neither a directory nor a hub model fails in one line
and leaves the run directory as it was, and no option of the CLI may be abbreviated."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import signal
import types
from pathlib import Path

import pytest
import yaml

from rlcore.config import ConfigError
from rlcore.loading.loader import build_config
from rlcore.controller.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "grpo_arith_tiny_cpu.yaml"


def _config(log_dir: Path, model: str = "m", checkpointing: bool = False):
    return build_config({"policy": {"model_name": model, "generation": {"backend": "hf"}},
                         "logger": {"log_dir": str(log_dir)}, "checkpointing": {"enabled": checkpointing}})


def _records_of_an_interrupted_run(config) -> None:
    RunDir(config).open().close()
    (Path(config.logger.log_dir) / "metrics.jsonl").write_text('{"step": 1}\n')


# ---- Ctrl-C without a checkpoint --------------------------------------------------------------------
@pytest.mark.parametrize("checkpointing", [False, True], ids=["checkpointing-off", "no-checkpoint-yet"])
def test_ctrl_c_at_once_without_a_checkpoint_says_what_works(tmp_path, capsys, checkpointing):
    from rlcore.cli.commands import interrupted

    config = _config(tmp_path / "run dir", checkpointing=checkpointing)
    assert interrupted(config) == 128 + signal.SIGINT
    assert "run the same command again to start afresh" in capsys.readouterr().err  # nothing recorded yet: true
    RunDir(config).open().close()  # and so it is

    _records_of_an_interrupted_run(config)
    interrupted(config)
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "run the same command again" not in said, said
    with pytest.raises(ConfigError, match="already holds the records"):  # which is why it must not say so
        RunDir(config).open()
    remove = re.search(r"\((rm -r .+?)\)", said).group(1)
    for path in shlex.split(remove)[2:]:  # the command it prints, quoting included
        shutil.rmtree(path)
    RunDir(config).open().close()  # the same command now starts afresh
    assert "logger.log_dir=<another directory>" in said


def test_ctrl_c_after_a_step_without_checkpoints_says_what_works(tmp_path, capsys):
    from rlcore.controller.checkpoint import stop_after_step

    config = _config(tmp_path / "run")
    owner = RunDir(config).open()
    owner.close()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 3}\n')
    loop = types.SimpleNamespace(stop_signal=signal.SIGINT, ckpt=None, step=3, identity=owner.identity())
    assert stop_after_step(loop, tmp_path / "run" / "checkpoints")
    said = capsys.readouterr().out
    assert "starts afresh" not in said and f"To start afresh, delete {tmp_path / 'run'} or run again with logger.log_dir=" in said
    RunDir(_config(tmp_path / "elsewhere")).open().close()  # the other way it names works too


# ---- a model that is not there ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["runs/nothere", "./nothere", "/abs/nothere", "a/b/nothere", "~/nothere-rlcore"])
def test_a_local_looking_model_path_is_never_looked_up_on_the_hub(tmp_path, monkeypatch, name):
    import rlcore

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # `runs/nothere`: a run directory of this checkout, not a hub organisation
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    config = _config(tmp_path / "runs" / "grpo", model=name)
    with pytest.raises(ConfigError, match="no such directory") as failure:
        rlcore.run(config)
    assert failure.value.key == "policy.model_name"
    assert not (tmp_path / "runs" / "grpo").exists()  # the failed run left nothing behind


def test_a_hub_name_that_is_not_there_fails_in_one_line_and_leaves_nothing(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli("run", str(RECIPE), "policy.model_name=rlcore-no-such-org/no-such-model", f"logger.log_dir={run_dir}",
                   "policy.generation.backend=hf", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: config key 'policy.model_name'"), done.stderr  # no retries, no traceback
    assert "rlcore-no-such-org/no-such-model" in lines[0] and "not in the Hugging Face cache" in lines[0]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


def test_a_failed_start_keeps_what_the_directory_held_before(tmp_path):
    """A run that fails while starting removes only the files it wrote: another run's records stay."""
    import rlcore

    config = _config(tmp_path / "run", model=str(tmp_path / "gone"))
    _records_of_an_interrupted_run(config)
    before = json.loads((tmp_path / "run" / "run.json").read_text())
    with pytest.raises(ConfigError):
        rlcore.run(config)  # refused: this directory holds another run's records
    assert json.loads((tmp_path / "run" / "run.json").read_text()) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no such directory"):
        rlcore.run(_config(tmp_path / "other", model=str(tmp_path / "gone")))
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]


# ---- no abbreviated options -------------------------------------------------------------------------
def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:  # argparse keeps subparsers only there
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_of_the_cli_takes_abbreviations(capsys):
    from rlcore.cli.commands import build_parser
    from rlcore.cli.demo import build_parser as demo_parser
    from rlcore.cli.docs_reference import build_parser as reference_parser

    parsers = [*_parsers(build_parser()), demo_parser(), reference_parser()]
    assert len(parsers) > 10
    assert [p.prog for p in parsers if p.allow_abbrev] == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "r.yaml", "--resum"])
    assert "unrecognized arguments: --resum" in capsys.readouterr().err
    assert build_parser().parse_args(["run", "r.yaml", "--resume"]).resume is True
