"""CPU facts the backends need: how many physical cores this process may run on."""

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
