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
