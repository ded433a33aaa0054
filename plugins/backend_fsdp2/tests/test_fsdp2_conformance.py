"""rlcore's training-backend conformance suite, run against the fsdp2 backend in this process
(a world-size-1 gloo group: the same FSDP2/DTensor code path as a multi-rank run)."""

from __future__ import annotations

import pytest

from rlcore.testing.conformance import TrainingBackendConformance


# single_process_group: rlcore.testing's pytest plugin.
class TestFSDP2Conformance(TrainingBackendConformance):
    logprob_atol = 1e-5  # fp32, same kernels as transformers

    @pytest.fixture(scope="class")
    def backend_model_dir(self, tiny_model_dir):
        return tiny_model_dir

    @pytest.fixture(scope="class")
    def training_backend(self, single_process_group, backend_model_dir):
        from rlcore.config.schema import PolicyConfig, RunConfig, SequencePackingConfig
        from rlcore.interfaces import WorldInfo
        from rlcore.plugins import get_plugin_manager
        from rlcore_fsdp2.config import SECTION

        reg = get_plugin_manager().get("training_backend", "fsdp2")
        policy = PolicyConfig(model_name=str(backend_model_dir), precision="float32",
                              sequence_packing=SequencePackingConfig(train_mb_tokens=24, logprob_mb_tokens=24))
        config = RunConfig(policy=policy, sections={SECTION: reg.config_cls()})
        backend = reg.build(config, config.section(SECTION), WorldInfo())
        yield backend
        backend.shutdown()


def test_compiled_decoder_trains_like_eager(single_process_group, tiny_model_dir):
    """``compile: true`` on one rank (FSDP2 at the root only, compiled decoder layers): logprobs
    after a step and the step's metrics match eager."""
    import torch

    from rlcore.algorithms.sft import SFT
    from rlcore.config.schema import OptimizerConfig, PolicyConfig, RunConfig, SequencePackingConfig
    from rlcore.interfaces import SequenceBatch, WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    g = torch.Generator().manual_seed(0)
    # two micro-batches of 23 tokens (9 + 14, 14 + 9), both longest 14: the compiled layers are
    # traced once for the logprobs and once for the training step (another length or longest
    # sequence recompiles every layer, most of this test's time on a CPU)
    ids = [torch.randint(3, 100, (n,), generator=g) for n in (9, 14, 14, 9)]
    batch = SequenceBatch(input_ids=ids, loss_mask=[torch.ones(len(x)) for x in ids])
    runs = []
    for compile_ in (False, True):
        cfg = DTensorConfig(compile=compile_)
        # Adam eps = lr: the update is linear in the gradient (~lr * g / eps), so fp32 rounding of the
        # compiled kernels stays rounding in the weights (not an lr-sized sign flip on a near-zero
        # gradient), and the step moves the logprobs far more than the default lr (1e-6) would
        policy = PolicyConfig(model_name=str(tiny_model_dir), precision="float32", optimizer=OptimizerConfig(lr=1e-2, eps=1e-2),
                              sequence_packing=SequencePackingConfig(train_mb_tokens=24, logprob_mb_tokens=24))
        backend = FSDP2Backend(RunConfig(policy=policy, sections={SECTION: cfg}), cfg, WorldInfo())
        assert len(backend.fsdp_modules) == 1  # the root only: nothing to free per layer on one rank
        before = backend.logprobs(batch)
        metrics = backend.train(batch, SFT())
        runs.append((metrics, before, backend.logprobs(batch)))
        backend.shutdown()
    (eager_metrics, eager_before, eager_after), (comp_metrics, _, comp_after) = runs
    # fp32 loss, a mean over 46 tokens: N * eps32 ~ 5e-6 relative; the gradient norm sums ~3e5 squares
    assert comp_metrics["loss"] == pytest.approx(eager_metrics["loss"], rel=1e-5)
    assert comp_metrics["grad_norm"] == pytest.approx(eager_metrics["grad_norm"], rel=1e-4)
    moved = max(float((a - b).abs().max()) for a, b in zip(eager_after, eager_before))
    assert moved > 1e-2, moved  # the step moves logprobs by 100x the tolerance below
    for a, b in zip(eager_after, comp_after):
        assert float((a - b).abs().max()) < 1e-4  # fp32 logprobs (|logp| ~ 5) of weights equal to rounding


def test_loaded_checkpoint_keeps_this_runs_optimizer_kernel(single_process_group, tiny_model_dir, tmp_path):
    """A checkpoint saved by a run that stepped without the fused kernel (CPU offload) loads into a
    fused run as fused: the update path (clip and skip on the device) follows this run's choice."""
    import torch

    from rlcore.algorithms.sft import SFT
    from rlcore.config.schema import PolicyConfig, RunConfig, SequencePackingConfig
    from rlcore.interfaces import SequenceBatch, WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorConfig

    def build():
        cfg = DTensorConfig()
        policy = PolicyConfig(model_name=str(tiny_model_dir), precision="float32",
                              sequence_packing=SequencePackingConfig(train_mb_tokens=24, logprob_mb_tokens=24))
        return FSDP2Backend(RunConfig(policy=policy, sections={SECTION: cfg}), cfg, WorldInfo())

    ids = [torch.arange(3, 15), torch.arange(5, 12)]
    batch = SequenceBatch(input_ids=ids, loss_mask=[torch.ones(len(x)) for x in ids])
    saver = build()
    saver.optimizer.defaults["fused"] = saver.optimizer.param_groups[0]["fused"] = False  # as with CPU offload
    saver.train(batch, SFT())
    saver.save_checkpoint(str(tmp_path / "ckpt"))
    saver.shutdown()
    loader = build()
    loader.load_checkpoint(str(tmp_path / "ckpt"))
    assert loader.optimizer.param_groups[0]["fused"] is True and loader.step == 1
    metrics = loader.train(batch, SFT())  # fused update with grad_scale/found_inf: must not raise
    assert "skipped_nonfinite" not in metrics and loader.step == 2
    loader.shutdown()


def test_one_rank_copy_in_is_chunk_cat():
    """one_rank.copy_in with one chunk gives FSDP2's own _chunk_cat result, cast included."""
    import torch

    from rlcore_fsdp2.one_rank import copy_in

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g).to(torch.bfloat16) for shape in [(3, 4), (5,), (2, 3, 2)]]
    numel = sum(t.numel() for t in grads)
    want, got = torch.empty(1, numel), torch.full((numel,), float("nan"))
    torch._chunk_cat(grads, 0, 1, out=want)
    copy_in(grads, got, 1)
    assert torch.equal(got, want[0])
    seen = []
    copy_in(grads, got, 2, original=lambda *args: seen.append(args[2]))  # several ranks: FSDP2's own code
    assert seen == [2]


def test_one_rank_step_matches_single_process_reference(single_process_group, tiny_model_dir):
    """One rank, several micro-batches: the gradients are accumulated unsharded (one_rank's foreach
    accumulation) and reduced once (one_rank's copy-in); the parameters after the step equal a
    plain Hugging Face AdamW step (fp32)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from _fsdp2_common import export, hf_state, load_hf, make_batch, max_diff, reference_train, run_config
    from rlcore.algorithms.sft import SFT
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION

    config = run_config(tiny_model_dir)
    backend = FSDP2Backend(config, config.section(SECTION), WorldInfo())
    assert hasattr(_fsdp_collectives.foreach_reduce_scatter_copy_in, "_rlcore_original")
    assert hasattr(FSDPParamGroup.post_backward, "_rlcore_original")
    batch = make_batch(3)
    metrics = backend.train(batch, SFT())
    assert metrics["num_micro_batches"] > 1
    params, _ = export(backend)
    backend.shutdown()
    model = load_hf(tiny_model_dir)
    (loss, norm), = reference_train(model, batch, SFT(), gbs=None)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5) and metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    diff = max_diff(params, hf_state(model))
    assert diff < 1e-5, f"params after a one-rank step differ from the reference by {diff}"


def test_one_rank_compiled_accumulation_matches_eager():
    """The compiled foreach kernels (the CUDA default), here on the CPU: fp32 += bf16 and the upcast."""
    import torch

    from rlcore_fsdp2.one_rank import _KERNELS

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g).to(torch.bfloat16) for shape in [(33, 7), (130,), (4, 5, 6)]]
    accs = [torch.randn(t.shape, generator=g) for t in grads]
    want = [a + b.float() for a, b in zip(accs, grads)]
    _KERNELS.run("add", True, accs, grads)
    assert not _KERNELS.failed
    for a, w in zip(accs, want):
        assert torch.equal(a, w)
    upcast = _KERNELS.run("upcast", True, grads, torch.float32)
    assert [u.dtype for u in upcast] == [torch.float32] * 3
    assert all(torch.equal(u, b.float()) for u, b in zip(upcast, grads))


def test_one_rank_bf16_accumulation_equals_fsdp2s_own(single_process_group, tiny_model_dir, monkeypatch):
    """bf16 compute, fp32 accumulation over micro-batches: the parameters after a step with
    one_rank's accumulation equal those with FSDP2's own per-parameter path, bit for bit."""
    import torch

    from _fsdp2_common import export, make_batch, run_config
    from rlcore.algorithms.sft import SFT
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2 import one_rank
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION

    calls = []
    real = one_rank.accumulate_group
    monkeypatch.setattr(one_rank, "accumulate_group", lambda group: calls.append(1) or real(group))
    config = run_config(tiny_model_dir, precision="bfloat16")
    results = []
    for ours in (True, False):
        monkeypatch.setattr(one_rank, "_on_one_rank", lambda group, ours=ours: ours)
        backend = FSDP2Backend(config, config.section(SECTION), WorldInfo())
        metrics = backend.train(make_batch(5), SFT())
        assert metrics["num_micro_batches"] > 2
        results.append(export(backend)[0])
        backend.shutdown()
    assert len(calls) == metrics["num_micro_batches"]  # the first run only
    ours, theirs = results
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_preallocated_grad_accumulators_train_like_fsdp2s_own(single_process_group, tiny_model_dir, monkeypatch):
    """The experiment ``preallocate_grad_accumulators``: from the second step on every trained parameter's float32
    accumulator exists before the first forward, and two steps of bf16 training over several micro-batches leave
    the parameters equal to those of FSDP2's own accumulation (the first backward adds into zeros)."""
    import torch

    from _fsdp2_common import export, make_batch, run_config
    from rlcore.algorithms.sft import SFT
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2 import accumulators
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION, DTensorExperimentalConfig

    made = []
    real = accumulators.preallocate
    monkeypatch.setattr(accumulators, "preallocate", lambda modules: made.append(real(modules)) or made[-1])
    results = []
    for preallocated in (True, False):
        config = run_config(tiny_model_dir, precision="bfloat16",
                            experimental=DTensorExperimentalConfig(preallocate_grad_accumulators=preallocated))
        backend = FSDP2Backend(config, config.section(SECTION), WorldInfo())
        trained = sum(p.requires_grad for p in backend.model.parameters())
        for step in range(2):
            assert backend.train(make_batch(10 + step), SFT())["num_micro_batches"] > 2
        results.append(export(backend)[0])
        backend.shutdown()
    assert made == [0, trained]  # the first run only: nothing to shape before the first gather
    ours, theirs = results
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_one_rank_replaces_what_this_torch_has():
    """The private FSDP2 names one_rank replaces are where, and of the shape, it expects. A torch
    release that moves or changes them fails here, loudly, before any run silently loses (or
    breaks) the fast paths: re-read FSDP2's code, adapt one_rank, add the release to CHECKED_TORCH."""
    import inspect

    import torch

    from rlcore_fsdp2 import one_rank

    where = f"torch {torch.__version__} (one_rank checked against {one_rank.CHECKED_TORCH})"
    assert torch.__version__.startswith(one_rank.CHECKED_TORCH), f"{where}: not a checked release"
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError as exc:
        pytest.fail(f"{where}: FSDP2's internals moved: {exc}")

    def original(fn):
        return getattr(fn, one_rank._ORIGINAL_ATTR, fn)

    copy_in = inspect.signature(original(collectives.foreach_reduce_scatter_copy_in))
    assert list(copy_in.parameters) == ["unsharded_grads", "reduce_scatter_input", "world_size"], f"{where}: {copy_in}"
    assert "foreach_reduce_scatter_copy_in(" in inspect.getsource(collectives.foreach_reduce), where  # looked up per call
    post_backward = inspect.signature(original(FSDPParamGroup.post_backward))
    assert list(post_backward.parameters) == ["self", "unused"], f"{where}: {post_backward}"
    param_src, group_src = inspect.getsource(FSDPParam), inspect.getsource(FSDPParamGroup)
    for name in ("unsharded_accumulated_grad", "_unsharded_param", "reduce_dtype", "offload_to_cpu"):
        assert f"self.{name}" in param_src, f"{where}: FSDPParam.{name} is gone"
    for name in ("fsdp_params", "reduce_grads", "mesh_info"):
        assert f"self.{name}" in group_src, f"{where}: FSDPParamGroup.{name} is gone"
    assert one_rank.install() is True
    assert hasattr(collectives.foreach_reduce_scatter_copy_in, one_rank._ORIGINAL_ATTR)
    assert hasattr(FSDPParamGroup.post_backward, one_rank._ORIGINAL_ATTR)
    one_rank.uninstall()


def test_one_rank_uninstall_restores_fsdp2_after_the_last_user(monkeypatch):
    """The replacement is process-wide only while a backend that asked for it lives: the last
    uninstall puts FSDP2's own functions back."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from rlcore_fsdp2 import one_rank

    def originals():
        return [getattr(f, one_rank._ORIGINAL_ATTR, f)
                for f in (collectives.foreach_reduce_scatter_copy_in, FSDPParamGroup.post_backward)]

    users, before = one_rank._users, originals()
    monkeypatch.setattr(one_rank, "_users", 0)
    try:
        assert one_rank.install() and one_rank.install()
        one_rank.uninstall()
        assert hasattr(FSDPParamGroup.post_backward, one_rank._ORIGINAL_ATTR)  # one user left
        one_rank.uninstall()
        assert [collectives.foreach_reduce_scatter_copy_in, FSDPParamGroup.post_backward] == before
    finally:
        for _ in range(users):  # put back what backends still alive in this session installed
            one_rank.install()
    assert originals() == before


@pytest.mark.parametrize("enabled", [True, False])
def test_one_rank_fast_paths_key_decides_the_replacement(single_process_group, tiny_model_dir, monkeypatch, enabled):
    from _fsdp2_common import run_config
    from rlcore.interfaces import WorldInfo
    from rlcore_fsdp2 import one_rank
    from rlcore_fsdp2.backend import FSDP2Backend
    from rlcore_fsdp2.config import SECTION

    from rlcore_fsdp2.config import DTensorExperimentalConfig

    calls = []
    monkeypatch.setattr(one_rank, "install", lambda: calls.append("install") or True)
    monkeypatch.setattr(one_rank, "uninstall", lambda: calls.append("uninstall"))
    config = run_config(tiny_model_dir, experimental=DTensorExperimentalConfig(one_rank_fast_paths=enabled))
    assert config.section(SECTION).experimental.one_rank_fast_paths is enabled
    FSDP2Backend(config, config.section(SECTION), WorldInfo()).shutdown()
    assert calls == (["install", "uninstall"] if enabled else [])
