"""The program the sandbox runs: set the limits, then run the untrusted solution on the hidden inputs.

Standard library only; it runs under ``python -I -S`` inside bubblewrap, its text passed with ``-c``.
It reads one JSON job on stdin (``solution``, ``entry_point``, ``inputs``, ``limits``), writes the
ready mark once the limits are set (anything that ends the sandbox before the mark is the sandbox's
failure, never the solution's), and at the end one result line: each input's return value (JSON) or
error. Expected outputs never enter the sandbox: the host compares, so a solution that forges the
result line still has to know the answers.
"""

import io
import json
import os
import resource
import signal
import sys

READY = "@@rlcore-sandbox-ready@@"
RESULT = "@@rlcore-sandbox-result@@ "


def _set_limits(limits):
    # Set here, inside the sandbox's user namespace: RLIMIT_NPROC then counts this sandbox's processes only.
    for name, value in (("RLIMIT_CPU", limits["cpu_time_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                        ("RLIMIT_FSIZE", limits["file_size_bytes"]), ("RLIMIT_NOFILE", limits["max_open_files"]),
                        ("RLIMIT_NPROC", limits["max_processes"]), ("RLIMIT_CORE", 0)):
        # CPU: SIGXCPU at the soft limit (reported as such), SIGKILL a second later at the hard one
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))


def _describe(exc):
    return f"{type(exc).__name__}: {exc}"[:300]


def _jsonable(value, depth=0):
    if depth > 20:
        raise ValueError("return value nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"return value of type {type(value).__name__} is not a number, string, list or dict")


def _on_alarm(signum, frame):
    raise TimeoutError("test took longer than its time limit")


def main():
    job = json.loads(sys.stdin.read())
    _set_limits(job["limits"])
    out = os.fdopen(os.dup(1), "w")
    out.write(READY + "\n")
    out.flush()
    sys.stdout = sys.stderr = io.StringIO()  # the solution's prints stay out of the result channel
    result = {"error": None, "tests": []}
    namespace = {"__name__": "solution"}
    try:
        exec(compile(job["solution"], "<solution>", "exec"), namespace)
        function = namespace.get(job["entry_point"])
        if not callable(function):
            raise NameError(f"the solution defines no function {job['entry_point']!r}")
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are the solution's too
        result["error"] = _describe(exc)
        function = None
    if function is not None:
        signal.signal(signal.SIGALRM, _on_alarm)
        for args in job["inputs"]:
            signal.setitimer(signal.ITIMER_REAL, job["limits"]["per_test_timeout_s"])
            try:
                result["tests"].append({"value": _jsonable(function(*args))})
            except BaseException as exc:  # noqa: BLE001
                result["tests"].append({"error": _describe(exc)})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        line = json.dumps(result)
    except (TypeError, ValueError) as exc:
        line = json.dumps({"error": _describe(exc), "tests": []})
    out.write(RESULT + line + "\n")
    out.flush()
    os._exit(0)  # no atexit handlers or finalizers of the solution run after the result


if __name__ == "__main__":  # run with -c; importing this module runs nothing
    main()
