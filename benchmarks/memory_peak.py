"""Where a CUDA step's peak memory goes: the tensors alive at the allocator's peak, grouped by the code that made them.

    report = memory_peak.record(lambda: backend.train(batch, algo))   # one more step, recorded
    print(report)

Runs the step under torch's allocator history (``torch.cuda.memory._record_memory_history``, the recorder behind
PyTorch's "Understanding CUDA Memory Usage" guide and its ``memory_viz`` page), then replays the recorded events:
the live bytes at their peak, by allocation site (the innermost frame outside torch's own files, with the
innermost torch function beside it), and the allocator's reserved bytes at their own peak (segments mapped).
Tensors allocated before the recording are one line ("held before the step": weights, gradients, optimizer
state), less what the step freed of them. Written here because the viewer is an HTML page, not a table a device
call can print.
"""

from __future__ import annotations

from collections import defaultdict

GIB = float(1 << 30)


def _site(frames: list[dict]) -> str:
    torch_fn = ""
    for frame in frames:  # innermost first
        name = frame.get("filename", "")
        if "/torch/" in name:
            torch_fn = torch_fn or frame.get("name", "")
            continue
        if name.startswith("??") or not name.endswith(".py"):
            continue
        short = "/".join(name.split("/")[-2:])
        return f"{short}:{frame.get('line')} {frame.get('name')}" + (f" -> {torch_fn}" if torch_fn else "")
    return f"torch: {torch_fn or '?'}"


def peak_table(snapshot: dict, device: int, held_before: int, top: int = 12) -> str:
    """The replay of ``snapshot``'s trace for ``device`` (see the module docstring) as a markdown table."""
    events = snapshot["device_traces"][device]
    live: dict[int, tuple[int, str, int]] = {}
    held, freed_before = held_before, 0
    current = peak = held
    at_peak: dict[int, tuple[int, str, int]] = {}
    held_at_peak = held
    # the segments mapped when the recording began: what is mapped at the end, less the mapping the trace did
    # (per stream too: the caching allocator gives a stream's freed blocks only to that stream's allocations)
    reserved_by_stream: dict[int, int] = defaultdict(int)
    for segment in snapshot["segments"]:
        if segment["device"] == device:
            reserved_by_stream[segment.get("stream", 0)] += segment["total_size"]
    for event in events:
        if event["action"] in ("segment_alloc", "segment_map"):
            reserved_by_stream[event.get("stream", 0)] -= event["size"]
        elif event["action"] in ("segment_free", "segment_unmap"):
            reserved_by_stream[event.get("stream", 0)] += event["size"]
    reserved = sum(reserved_by_stream.values())
    peak_reserved = reserved
    live_by_stream: dict[int, int] = defaultdict(int)  # the step's own tensors, by the stream they were made on
    streams_at_reserved_peak = streams_at_live_peak = _streams(reserved_by_stream, live_by_stream)
    for event in events:
        action, addr, size = event["action"], event["addr"], event["size"]
        stream = event.get("stream", 0)
        if action == "alloc":
            live[addr] = (size, _site(event.get("frames", [])), stream)
            live_by_stream[stream] += size
            current += size
        elif action == "free_completed":
            if addr in live:
                size_freed, _, made_on = live.pop(addr)
                live_by_stream[made_on] -= size_freed
                current -= size_freed
            else:  # a tensor from before the recording
                held -= size
                freed_before += size
                current -= size
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
            reserved_by_stream[stream] += size
            if reserved > peak_reserved:
                peak_reserved = reserved
                streams_at_reserved_peak = _streams(reserved_by_stream, live_by_stream)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
            reserved_by_stream[stream] -= size
        if current > peak:
            peak, at_peak, held_at_peak = current, dict(live), held
            streams_at_live_peak = _streams(reserved_by_stream, live_by_stream)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site, _ in at_peak.values():
        by_site[site][0] += size
        by_site[site][1] += 1
    rows = sorted(by_site.items(), key=lambda kv: -kv[1][0])
    lines = [f"peak of live tensors {peak / GIB:.2f} GiB (allocator's reserved peak {peak_reserved / GIB:.2f} GiB); "
             f"held before the step {held_before / GIB:.2f} GiB, of which {freed_before / GIB:.2f} freed during it",
             "| GiB at the peak | tensors | allocated at |", "|---:|---:|---|",
             f"| {held_at_peak / GIB:.2f} | - | held before the step (still alive at the peak) |"]
    lines += [f"| {size / GIB:.2f} | {count} | `{site}` |" for site, (size, count) in rows[:top]]
    rest = sum(size for _, (size, _) in rows[top:])
    if rest:
        lines.append(f"| {rest / GIB:.2f} | {sum(c for _, (_, c) in rows[top:])} | {len(rows) - top} other sites |")
    lines.append(f"by stream at the live peak: {streams_at_live_peak}")
    lines.append(f"by stream at the reserved peak: {streams_at_reserved_peak}")
    return "\n".join(lines)


def _streams(reserved_by_stream: dict[int, int], live_by_stream: dict[int, int]) -> str:
    """Each stream's reserved GiB and the GiB of the step's tensors made on it ("0" is the default stream; tensors
    from before the step count in no stream's second number)."""
    streams = sorted(set(reserved_by_stream) | set(live_by_stream), key=lambda s: (s != 0, s))
    parts = [f"{stream:#x} reserved {reserved_by_stream.get(stream, 0) / GIB:.2f} / step's tensors "
             f"{live_by_stream.get(stream, 0) / GIB:.2f}" for stream in streams
             if reserved_by_stream.get(stream, 0) or live_by_stream.get(stream, 0)]
    return "; ".join(parts) or "none"


def record(step, top: int = 12) -> str:
    """Run ``step()`` once with the allocator's history recorded; the table of :func:`peak_table`."""
    import torch

    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    held_before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak_table(snapshot, device, held_before, top)
