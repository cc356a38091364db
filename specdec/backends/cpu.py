"""CPU facts the backends need: how many physical cores this process may run on, and which thread counts
make sense here; and the CPU's name, for benchmark reports."""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Physical CPU cores this process may run on: distinct (``physical id``, ``core id``) pairs of
    the /proc/cpuinfo processors in its CPU affinity set; ``os.cpu_count()`` where that fails."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores, proc, phys = set(), -1, "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (x.strip() for x in line.partition(":"))
                if key == "processor":
                    proc = int(value)
                elif key == "physical id":
                    phys = value
                elif key == "core id" and (allowed is None or proc in allowed):
                    cores.add((phys, value))
    except (OSError, ValueError):
        pass
    return len(cores) or (len(allowed) if allowed else os.cpu_count()) or 1


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's ``model name``), or ``"unknown"``."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


THREADS_PER_CPU_MAX = 4
"""Most compute threads per logical CPU that :func:`check_threads` allows: llama.cpp runs best with one
thread per physical core, and far more only makes every call wait on the scheduler (20,000 threads on
2 CPUs left a machine at a load average of 7,000)."""


def check_threads(n_threads: int | None, name: str = "n_threads") -> None:
    """Raise ValueError unless ``n_threads`` is None (the backend's default) or between 1 and
    :data:`THREADS_PER_CPU_MAX` times this machine's logical CPUs; the message names ``name``."""
    if n_threads is None:
        return
    cpus = os.cpu_count() or 1
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
        raise ValueError(f"{name} must be at least 1, got {n_threads!r}")
    if n_threads > THREADS_PER_CPU_MAX * cpus:
        raise ValueError(f"{name} {n_threads} is more than {THREADS_PER_CPU_MAX}x the {cpus} CPUs here; "
                         f"one thread per physical core ({physical_cores()} here) runs fastest")
