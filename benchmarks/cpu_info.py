"""The CPU's name and instruction-set flags from /proc/cpuinfo, for the records every CPU figure carries (no torch
import, so that drivers which only start processes can use it)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# The flags that decide which of fastformer's and its peers' loops run, named in every CPU record.
RECORDED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def first_core_fields() -> dict[str, str]:
    """-> the first core's /proc/cpuinfo fields ("model name", "cpu family", "model", "flags", ...); {} without it."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def model_name(fields: dict[str, str]) -> str:
    """first_core_fields' "model name", or the machine's architecture without it."""
    return fields.get("model name", platform.machine() or "cpu")


def cpu_name_and_flags() -> tuple[str, set[str]]:
    """-> ("<model name>, family F model M", its flags); the architecture and no flags without /proc/cpuinfo."""
    fields = first_core_fields()
    name = model_name(fields)
    # A virtual machine may call every generation "AMD EPYC": the family and model tell Zen 4 (25, 17) from Zen 5.
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return name, set(fields.get("flags", "").split())


def cpu_description() -> str:
    """"<model name>, family F model M, <n> cores (<the recorded flags it has>)"."""
    name, flags = cpu_name_and_flags()
    features = [flag for flag in RECORDED_FLAGS if flag in flags]
    return f"{name}, {os.cpu_count()} cores ({' '.join(features) or 'no AVX2'})"


def cpu_slug() -> str:
    """"cpu-<model name as a file-name-safe slug>-<n>core", for results folders."""
    name = re.sub(r"[^a-z0-9]+", "-", model_name(first_core_fields()).lower()).strip("-")
    return f"cpu-{name}-{os.cpu_count()}core"
