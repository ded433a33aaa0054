"""Two-step CPU dry runs of recipes, one after another in one process (launched by test_recipes.py).

Usage: python _recipe_dry_runs.py PLAN_JSON OUT_JSON. The plan maps each recipe's name to its
dry-run config (the recipe with tiny-model swaps, a dict) and the overrides its header asks for;
each is run with ``rlcore.run`` and its summary (or the traceback) is written to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> None:
    import rlcore

    plan = json.loads(open(sys.argv[1]).read())
    results = {}
    for name, item in plan.items():
        started = time.perf_counter()
        try:
            config = rlcore.build_config(item["config"], item["overrides"])
            result = rlcore.run(config)
            summary = result["summary"]
            logged = sorted({key for record in result.get("records") or [] for key in record})
            results[name] = {"steps": summary["steps"], "val_last": summary["val/accuracy_last"], "logged": logged,
                             "step_s": summary.get("timing/total"), "seconds": time.perf_counter() - started}
        except Exception:  # noqa: BLE001 - reported to the test, which fails naming the recipe
            results[name] = "ERROR " + traceback.format_exc()
        print(f"dry run {name}: {time.perf_counter() - started:.1f}s", flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
