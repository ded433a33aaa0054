"""rlcore's training-backend conformance suite against the megatron backend (world size 1, gloo).

Not collected directly (the CPU shims replace a few ``torch.cuda`` functions process-wide, which
other plugins' tests in the same pytest process should not see): ``test_megatron_conformance.py`` runs
this file in a subprocess.
"""

from __future__ import annotations

import pytest

from rlcore.testing.conformance import TrainingBackendConformance


# single_process_group: rlcore.testing's pytest plugin.
class TestMegatronConformance(TrainingBackendConformance):
    logprob_atol = 1e-5  # fp32

    @pytest.fixture(scope="class")
    def backend_model_dir(self, tiny_model_dir):
        return tiny_model_dir

    @pytest.fixture(scope="class")
    def training_backend(self, single_process_group, backend_model_dir):
        from rlcore import build_config
        from rlcore.interfaces import WorldInfo
        from rlcore.plugins import get_plugin_manager

        manager = get_plugin_manager()
        config = build_config({"policy": {"model_name": str(backend_model_dir), "precision": "float32",
                                          "sequence_packing": {"train_mb_tokens": 24, "logprob_mb_tokens": 24},
                                          "megatron_cfg": {"enabled": True}}}, manager=manager)
        reg = manager.get("training_backend", "megatron")
        backend = reg.build(config, config.section(reg.section), WorldInfo())
        yield backend
        backend.shutdown()
