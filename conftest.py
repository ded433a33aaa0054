"""The suite's order: files with slow tests first.

`make test` runs two pytest-xdist workers that each take a whole file at a time (``--dist loadfile``), in the
order of collection (``--no-loadscope-reorder``, pytest-xdist 3.8: xdist's own reorder puts the files with the most
tests first, which left the few-test integration files, the longest ones, to the end, where one worker ran them while
the other sat idle). Handing out the slow files first (``slow``: more than ~30 s on 2 cores) lets the many short ones fill the
gaps at the end.

vLLM's ahead-of-time compile cache is off for the suite (``VLLM_USE_AOT_COMPILE=0``, set for every process the tests
start): with the oldest set's torch (2.13) vLLM 0.27 cannot load what it saved ("'function' object has no attribute
'finalize_loading'") and compiles the model again at every engine start, about 5 s more than a start from Inductor's
own cache on 2 cores; the compiled model is the same either way.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: collection order within each group
