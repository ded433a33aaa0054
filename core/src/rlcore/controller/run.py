"""``rlcore.run``: open the run directory, write the resolved config once, and hand the run to the
loop for what the recipe's algorithm trains on (its ``trains_on`` capability).

Placement (:mod:`rlcore.controller.placement`) is computed once and handed to the backend and
generator factories. Ray trainer ranks use a local Ray instance when neither
``cluster.ray_address`` nor ``RAY_ADDRESS`` names a cluster; the generator stays with the driver
unless its plugin places its engines itself. Parts are built in :mod:`rlcore.controller.engines` and :mod:`rlcore.controller.task`.
"""

from __future__ import annotations

from pathlib import Path

from rlcore.controller.allocator import use_expandable_segments
from rlcore.controller.checks import check_before_start
from rlcore.config import ConfigError, RunConfig
from rlcore.controller.engines import seed_everything
from rlcore.deadlines import SIGTERM_DEADLINE
from rlcore.controller.given import check_given
from rlcore.controller.grpo_run import run_grpo
from rlcore.controller.heartbeat import heartbeat
from rlcore.controller.pairs import run_pairs
from rlcore.controller.run_dir import RunDir, write_run_config
from rlcore.controller.run_skeleton import trains_on
from rlcore.controller.sft import run_sft
from rlcore.data.reward_fn import as_environment
from rlcore.controller.verbosity import apply_verbosity

# What the algorithm trains on (its registration's ``trains_on``) -> the loop that runs it.
LOOPS = {
    None: run_grpo,  # prompts: the policy's own rollouts, scored by the environment (GRPO and its family)
    "prompts": run_grpo,
    "answers": run_sft,  # the dataset's reference answers, no rollouts (sft)
    "pairs": run_pairs,  # preference pairs, no rollouts (dpo, reward_model)
}


def run(config: RunConfig, **given) -> dict:
    if config is None:
        raise ConfigError("", "rlcore.run needs a RunConfig (rlcore.load_config(path) or rlcore.build_config(dict))")
    given = as_environment(given)  # reward_fn=fn: a plain function scores the rollouts
    check_given(given)  # before the run directory is claimed: a wrong object fails at once
    apply_verbosity(config.logger.verbosity)  # before vLLM, transformers or Ray is imported
    use_expandable_segments()  # before this process or any it starts initializes CUDA
    check_before_start(config, given)  # names, env.reward_fn, the enabled loggers' packages
    seed_everything(config.train.seed, config.train.deterministic)
    run_dir = Path(config.logger.log_dir)
    owner = RunDir(config).open()
    try:
        kind = trains_on(config)
        if kind not in LOOPS:
            raise ConfigError("algorithm.name", f"algorithm '{config.section('algorithm').name}' trains on {kind!r}; "
                              f"rlcore runs algorithms that train on {sorted(k for k in LOOPS if k)}")
        write_run_config(config)
        with heartbeat(enabled=config.logger.print_table):  # a line every 10 s while the run is silent
            return LOOPS[kind](config, owner, run_dir, given)
    except BaseException:
        owner.discard_if_unused()  # a run that failed before its first record leaves no files behind
        raise
    finally:
        SIGTERM_DEADLINE.disarm()  # the run has ended: from here on the caller (rlcore run: exit_timeout_s) decides
        owner.close()
