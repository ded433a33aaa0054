"""Conformance tests every rlcore plugin of a kind must pass, for a plugin's own CI.

Subclass the suite of your plugin's kind in a test module (name the subclass ``Test...``) and
provide the fixtures it asks for; pytest collects the inherited tests::

    import pytest
    from rlcore.testing.conformance import EnvironmentConformance

    class TestMyEnv(EnvironmentConformance):
        @pytest.fixture
        def environment(self):
            from my_package.env import MyEnv
            return MyEnv()

Suites and their fixtures (required ones first; the others have defaults you may override):

- :class:`EnvironmentConformance`: ``environment``; ``env_samples``, ``env_graded_examples``.
- :class:`AlgorithmConformance`: ``algorithm``; ``algorithm_name`` (the registered name, to
  check the registration).
- :class:`TrainingBackendConformance`: ``training_backend``, ``backend_model_dir`` (the Hugging
  Face checkpoint the backend was built from, fp32 recommended); ``backend_algorithm``.
- :class:`GeneratorConformance`: ``generator``, ``generator_model_dir`` (the checkpoint it serves).

Each suite's ``test_implements_protocol`` names any member of the kind's protocol in
:mod:`rlcore.interfaces` that the object lacks (:func:`assert_follows`), and the optional members
it has are checked too (see the protocol docstrings).

Expensive objects may use ``scope="class"``: tests that change weights run after those that
compare against the checkpoint (pytest keeps definition order). Tolerances are class attributes
(``logprob_atol``, ``max_step_seconds``). To opt out of one test, override it in the subclass
with ``@pytest.mark.skip(reason=...)``. Heavy imports (torch, transformers) happen inside the
tests, so importing this module is cheap.
"""

from rlcore.testing.conformance.algorithms import AlgorithmConformance, make_algorithm_batch
from rlcore.testing.conformance.environments import JUNK_RESPONSES, EnvironmentConformance, default_samples
from rlcore.testing.conformance.members import assert_follows
from rlcore.testing.conformance.models import (
    GeneratorConformance,
    TrainingBackendConformance,
    checkpoint_tensors,
    hf_reference_logprobs,
)

__all__ = [
    "AlgorithmConformance",
    "EnvironmentConformance",
    "GeneratorConformance",
    "TrainingBackendConformance",
    "JUNK_RESPONSES",
    "assert_follows",
    "checkpoint_tensors",
    "default_samples",
    "hf_reference_logprobs",
    "make_algorithm_batch",
]
