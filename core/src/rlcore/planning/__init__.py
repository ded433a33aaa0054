"""Sizing and automatic layout: predicted memory per GPU by part and step time by phase for candidate
layouts of a run, ranked (``rlcore plan``), and the choice behind ``layout: auto``; imports config and loading.

    from rlcore.loading.loader import load_config
    from rlcore.planning import plan
    inp = plan.inputs(load_config("recipes/grpo_math_8B_megatron.yaml"), gpus=8)
    best = plan.plan(inp)[0]
    print(best.layout.describe(8), best.memory.peak_gib, best.phases)

The model's formulas and what it leaves out: ``docs/guides/planning.md``.
"""
