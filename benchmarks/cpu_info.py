"""The CPU's name and instruction-set flags from /proc/cpuinfo, for the records every CPU figure carries (no torch
import, so that drivers which only start processes can use it)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# The flags that decide which of fastformer's and its peers' loops run, named in every CPU record.
RECORDED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_name_and_flags() -> tuple[str, set[str]]:
    """-> (the first core's model name, its flags); the machine's architecture and no flags without /proc/cpuinfo."""
    name, flags = platform.machine() or "cpu", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return name, flags


def cpu_description() -> str:
    """"<model name>, <n> cores (<the recorded flags it has>)"."""
    name, flags = cpu_name_and_flags()
    features = [flag for flag in RECORDED_FLAGS if flag in flags]
    return f"{name}, {os.cpu_count()} cores ({' '.join(features) or 'no AVX2'})"


def cpu_slug() -> str:
    """"cpu-<model name as a file-name-safe slug>-<n>core", for results folders."""
    name = re.sub(r"[^a-z0-9]+", "-", cpu_name_and_flags()[0].lower()).strip("-")
    return f"cpu-{name}-{os.cpu_count()}core"
