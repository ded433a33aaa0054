"""The members every run uses of each protocol: what ``rlcore.run`` checks of the objects it is
given and what the plugin manager checks of what a plugin's factory returns (members only some
runs use are declared by the small optional protocols beside each kind)."""

from __future__ import annotations

from typing import Any

from rlcore.interfaces import data, generation, loggers, training

# keyword of rlcore.run -> (protocol, the members every run uses: "name()" a method, "name" an attribute)
REQUIRED: dict[str, tuple[type, tuple[str, ...]]] = {
    "algorithm": (training.Algorithm, ("name", "uses_reference", "uses_old_logprobs", "loss_level",
                                       "shape_rewards()", "keep_trajectories()", "advantages()", "loss()")),
    "environment": (generation.Environment, ("step()",)),
    "dataset": (data.PromptDataset, ("train", "validation")),
    "backend": (training.TrainingBackend, ("logprobs()", "train()", "export_weights()", "shutdown()")),
    "generator": (generation.Generator, ("weights_version", "generate()", "update_weights()")),
}
# plugin kind -> what its factory's product must have (rlcore.plugins.Registration.build checks it);
# every kind of rlcore.plugins.KINDS has an entry (a test checks it)
BUILT_CHECKS: dict[str, tuple[type, tuple[str, ...]]] = {
    "environment": REQUIRED["environment"], "generator": REQUIRED["generator"], "algorithm": REQUIRED["algorithm"],
    "dataset": REQUIRED["dataset"], "training_backend": REQUIRED["backend"],
    "logger": (loggers.MetricLogger, ("log()", "close()")),
}


def missing_members(obj: Any, members: tuple[str, ...]) -> list[str]:
    """The entries of ``members`` that ``obj`` lacks (a method must be callable)."""
    missing = []
    for member in members:
        name = member.removesuffix("()")
        if member.endswith("()") and not callable(getattr(obj, name, None)) or not hasattr(obj, name):
            missing.append(member)
    return missing
