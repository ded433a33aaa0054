"""``rlcore bench``: how fast rlcore runs a recipe on this machine.

    rlcore bench step RECIPE [KEY=VALUE ...] [--steps N --warmup K] [--shape S] [--out DIR]
    rlcore bench generate|train|refit RECIPE [...]     # one part of the step, timed alone
    rlcore bench component NAME RECIPE [...]           # a plugin's component benchmark
    rlcore bench list                                  # the plugins' component benchmarks

``step`` builds a random-init model of the recipe's model configuration
(:mod:`rlcore.cli.bench.models`; nothing is downloaded), runs ``--steps`` steps through ``rlcore.run``
(the path ``rlcore run`` takes), and prints NeMo-RL's step-time table (step, training, refit,
generation, logprobs, tokens per sample: means of the steps after ``--warmup``) with generated
tokens per GPU-second (per second, on a CPU: its rows say ``gpus`` 0) and training MFU against the device's peak (:data:`PEAK_FLOPS`). Responses run
to ``max_new_tokens`` (``ignore_eos``), so a random model does the work a trained one would; its
rewards are about 0, which changes no step's work. One JSON row (figures, versions, device, the
resolved config's digest, the commit in a checkout) is appended to ``<out>/bench.jsonl``.

``generate``, ``train`` and ``refit`` build the same run and time one part of the step alone
(:mod:`rlcore.cli.bench.parts`). Plugins add component benchmarks with the ``rlcore_benchmarks`` hook.
"""

from __future__ import annotations

from rlcore.cli.bench.cli import add_parser, main
from rlcore.cli.bench.report import PEAK_FLOPS, peak_flops

__all__ = ["PEAK_FLOPS", "add_parser", "main", "peak_flops"]
