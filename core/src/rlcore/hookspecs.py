"""The hooks a plugin of rlcore may implement.

A plugin is any module reachable through an entry point of group ``rlcore``::

    [project.entry-points.rlcore]
    myenv = "my_package.plugin"

The module implements one or more of the hooks below with ``@rlcore.hookimpl``. Registration
hooks receive a ``register`` callable::

    register(name, factory, config_cls=None, *, section=None, **capabilities)

- ``name``: what users write in recipes (``grpo``, ``fsdp2``, ``math``). Names are unique per
  kind; a second provider of the same name is an error naming both.
- ``factory``: a callable that builds the object. Heavy imports (torch, vllm, megatron) belong
  inside it, so that ``rlcore plugins`` lists everything without importing them. A string
  ``"module:attr"`` is accepted too and resolved only when the factory is first called.
- ``config_cls``: a frozen ``attrs`` class, the schema of the plugin's config section; its
  module must import without torch. ``None`` means the plugin takes no configuration.
- ``section``: the dotted config path the schema owns. Each kind has a default (see each hook);
  training backends must name theirs (``policy.dtensor_cfg``, ``policy.megatron_cfg``).
- ``capabilities``: plain data (strings, numbers, booleans, tuples of them) describing what the
  provider supports, e.g. ``devices=("cpu", "cuda")``, ``parallelism=("dp", "tp")``,
  ``packing=True``. They are shown by ``rlcore plugins`` and checked by the run planner.

Each factory's call contract is stated in the hook that registers it. Objects it returns follow
the protocols in :mod:`rlcore.interfaces`.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("rlcore")


@hookspec
def rlcore_training_backends(register):
    """Register training backends (kind ``training_backend``).

    Factory: ``factory(config: RunConfig, section_config, world: WorldInfo) -> TrainingBackend``,
    called once in each trainer rank; ``world.placement`` is the run's
    :class:`rlcore.interfaces.Placement`. ``section`` is required and names the config block whose
    ``enabled: true`` selects this backend (e.g. ``policy.megatron_cfg``): its schema must have a
    bool field ``enabled``. Capability ``precedence`` (int, default 0) decides between several
    enabled backends: highest wins. :mod:`rlcore.training.steps` is the outer layer a backend's
    ``train`` is built from; :mod:`rlcore.training.schedule` turns ``policy.scheduler`` into its learning
    rate. A complete third-party example: ``examples/ddp_backend_plugin``.
    """


@hookspec
def rlcore_generators(register):
    """Register rollout generators (kind ``generator``).

    Factory: ``factory(config: RunConfig, section_config, placement: Placement) -> Generator``,
    with the same :class:`rlcore.interfaces.Placement` the backend got. Default section:
    ``policy.generation``, shared by all generators; its ``backend`` key picks one by name. The
    schema (``config_cls``) must extend :class:`rlcore.config.GenerationConfig` (the sampling keys,
    ``colocated`` and ``refit``, all that core reads of the section); none given means that base.
    A generator plugin that moves weights its own way also implements
    :func:`rlcore_weight_transport` (example: ``examples/hf_static_generator_plugin``).
    A generator whose engine runs in a process of its own overrides the schema's
    :meth:`rlcore.config.GenerationConfig.engine_in_own_process` (the run's memory plan counts that
    process's CUDA context on the trainer's GPU while the engine sleeps).
    """


@hookspec
def rlcore_environments(register):
    """Register environments that score trajectories (kind ``environment``).

    Factory: ``factory(section_config) -> Environment``. Default section: ``env.<name>``. With
    capability ``multi_turn=True`` the schema extends
    :class:`rlcore.config.environment.MultiTurnEnvConfig` (the turn settings core reads).
    """


@hookspec
def rlcore_algorithms(register):
    """Register RL algorithms: advantage estimation and loss (kind ``algorithm``).

    Factory: ``factory(section_config) -> Algorithm``. Default section: ``algorithm``, shared
    by all algorithms; its ``name`` key picks one.

    The ``trains_on`` capability picks the run loop: absent, the GRPO loop (the policy's own
    rollouts); ``"answers"``, the SFT loop (prompt + reference response, :mod:`rlcore.controller.sft`);
    ``"pairs"``, the pairwise loop (preference pairs, :mod:`rlcore.controller.pairs`), which also
    needs ``pair_trainer="module:attr"``, a factory ``(config, algorithm, tokenizer) -> PairTrainer``.
    """


@hookspec
def rlcore_datasets(register):
    """Register prompt datasets (kind ``dataset``).

    Factory: ``factory(section_config, tokenizer) -> PromptDataset`` (a sequence of
    :class:`rlcore.interfaces.Sample`). Default section: ``data``; its ``name`` key picks one.
    """


@hookspec
def rlcore_loggers(register):
    """Register metric loggers (kind ``logger``).

    Factory: ``factory(section_config, run_dir: pathlib.Path) -> MetricLogger``.
    Default section: ``logger.<name>``; a logger runs when its section has ``enabled: true``.
    """


@hookspec(firstresult=True)
def rlcore_weight_transport(trainer, generator):
    """Pick how weights move from the trainer ranks to ``generator`` at refit.

    Called once per run with the generator and the trainer handle (a
    :class:`rlcore.interfaces.TrainerHandle`, wherever its ranks run): ``export_chunks(dtype,
    chunk_bytes)`` yields rank 0's Hugging Face-named chunks in the caller's process;
    ``run_on_ranks(fn, *args, what=...)`` runs ``fn(backend, rank, world_size, *args)`` (``fn`` a
    ``"module:attr"`` string, imported in each rank's process) next to every rank's backend and
    returns all ranks' results; ``in_process`` says whether rank 0's backend lives in the caller's
    process (one rank, no Ray, or a backend object passed to ``rlcore.run``).

    The returned transport's ``transfer(trainer, generator)`` later gets that same handle.
    Return a :class:`rlcore.interfaces.WeightTransport` (its ``name`` and ``transfer``; anything
    else fails as the run starts) if this plugin knows how to connect the two, or ``None`` to let
    another plugin decide. The first non-``None`` answer wins; plugins
    registered later are asked first (pluggy's LIFO order), so a third party can override the
    built-in choice. rlcore's own fallback streams ``export_chunks()`` into
    ``generator.update_weights()``.
    """


@hookspec(firstresult=True)
def rlcore_wrap_trainer(trainer):
    """Wrap the run's trainer handle before the run's first call to it (GRPO-family runs).

    Called once per run with the :class:`rlcore.interfaces.TrainerHandle` the run built; return an
    object following the same protocol that forwards to it (and adds, e.g., tracing or the faults
    a test injects: :mod:`rlcore.testing.faults`), or ``None`` to leave it as it is. The first
    non-``None`` answer wins.
    """


@hookspec(firstresult=True)
def rlcore_export_checkpoint(backend, checkpoint_dir, config, out_dir):
    """Write the policy held in a training backend's checkpoint as a Hugging Face model.

    Called by ``rlcore export`` in one process, with no process group started. ``backend`` is the
    registered name of the training backend the run used (``fsdp2``, ``megatron``);
    ``checkpoint_dir`` the backend's part of an rlcore checkpoint (``step_N/backend``, as its
    ``save_checkpoint`` wrote it, under whatever parallel layout); ``config`` the run's
    :class:`rlcore.config.RunConfig`; ``out_dir`` where the safetensors, ``config.json`` and the
    tokenizer of ``policy.tokenizer_name`` (default ``policy.model_name``) go, in the run's
    training precision. Only the model's weights are read (no optimizer state).

    Return ``out_dir`` when this plugin wrote it, ``None`` when ``backend`` is not this plugin's.
    """


@hookspec
def rlcore_benchmarks():
    """Component benchmarks this plugin provides to ``rlcore bench component NAME RECIPE``.

    Return a dict ``{name: benchmark}``, each benchmark a callable or a ``"module:attr"`` string
    (imported only when run) of ``benchmark(config, steps, warmup) -> dict[str, float]``: ``config``
    is the recipe's :class:`rlcore.config.RunConfig` with the command's overrides (a component that
    needs a model builds or names its own); run the component ``steps`` times and report means of the repetitions
    after the first ``warmup``, under stable names (``seconds``, ``tokens_per_s``, ``gb_per_s``...).
    The bench prints them as a table and appends them, with the device, versions and the config's
    digest, to the bench's ``bench.jsonl``. Names are unique across plugins.
    """
