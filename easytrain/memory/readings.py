"""Memory readings of one node: RAM (host or container), processes' RSS, GPUs through NVML.

Each reading is a plain dict (the line written to ``memory.jsonl``), so the
sampler, the driver's checks, the plot and a recorded trace all share one
format. The GPU path is kept to three NVML calls behind :func:`gpu_readings`,
which takes the NVML module as an argument: on a GPU node that is
``pynvml`` (the ``nvidia-ml-py`` package), in tests a recorded reading of the
same shape.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import psutil


CGROUP = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60
"""cgroup v1 reports "no limit" as a huge number (page-rounded LONG_MAX)."""


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory(root: Path = CGROUP) -> Optional[tuple[int, int]]:
    """(working set, limit) in bytes of this process's memory cgroup, when it has a limit.

    The working set is usage minus the inactive page cache, the figure Kubernetes evicts a pod on (v2:
    ``memory.current`` - ``inactive_file``; v1: ``memory.usage_in_bytes`` - ``total_inactive_file``).
    """
    v2_limit = _read_int(root / "memory.max")
    if v2_limit is not None:
        usage, limit = _read_int(root / "memory.current"), v2_limit
        inactive = _stat(root / "memory.stat", "inactive_file")
    else:
        v1 = root / "memory"
        limit = _read_int(v1 / "memory.limit_in_bytes") or UNLIMITED
        usage = _read_int(v1 / "memory.usage_in_bytes")
        inactive = _stat(v1 / "memory.stat", "total_inactive_file")
    if usage is None or limit >= UNLIMITED:
        return None
    return max(0, usage - inactive), limit


def node_ram(limit_bytes: Optional[int] = None, cgroup_root: Path = CGROUP,
             run_bytes: Optional[int] = None) -> dict[str, Any]:
    """This node's RAM: used and the limit its fraction is taken of.

    The limit is the tightest of the host's memory, the container's cgroup limit (a KubeRay pod) and
    ``limit_bytes`` (``watchdog.ram_limit_gb``; ignored when larger). Used is the host's total minus available (what Ray's
    monitor uses), or the cgroup's working set when the container limit is the tighter one; with ``run_bytes``
    (``watchdog.ram_scope=run``: the summed RSS of the run's processes) it is that, and ``node_used_bytes``
    keeps the node's whole use beside it.
    """
    vm = psutil.virtual_memory()
    used, limit, source = vm.total - vm.available, vm.total, "host"
    container = cgroup_memory(cgroup_root)
    if container is not None and container[1] < limit:
        used, limit, source = container[0], container[1], "cgroup"
    if limit_bytes is not None and limit_bytes < limit:
        limit, source = limit_bytes, "config"
    scope = {"scope": "node"}
    if run_bytes is not None:
        scope = {"scope": "run", "node_used_bytes": int(used)}
        used = run_bytes
    return {"kind": "node", "ram_used_bytes": int(used), "ram_total_bytes": int(vm.total),
            "ram_limit_bytes": int(limit), "ram_fraction": used / limit if limit else 0.0, "source": source, **scope}


def process_rss(pid: int) -> Optional[int]:
    """Resident set size of ``pid`` in bytes; None when the process is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def open_nvml() -> Any:
    """The initialised NVML module, or None where there is no NVIDIA driver (CPU runs report RAM alone)."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no package, no driver, no GPU: all mean "no GPU readings"
        return None


def gpu_readings(nvml: Any) -> list[dict[str, Any]]:
    """Used/total memory and UUID of every GPU NVML sees on this node (``nvmlDeviceGetMemoryInfo``; the UUID
    matches a worker's reading to its GPU whatever ``CUDA_VISIBLE_DEVICES`` numbered it)."""
    readings = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        total = int(info.total)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        readings.append({"kind": "gpu", "index": index, "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                         "used_bytes": int(info.used), "total_bytes": total,
                         "fraction": int(info.used) / total if total else 0.0})
    return readings


def process_info(role: str, rank: int) -> dict[str, Any]:
    """Who and where this process is: pid, role, rank, Ray node, and its RSS now."""
    import ray

    pid = os.getpid()
    return {"pid": pid, "role": role, "rank": rank, "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "rss_bytes": process_rss(pid) or 0}


def _cuda_in_use() -> bool:
    """Whether this process has touched CUDA (without importing torch into processes that never did)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


def torch_allocator() -> dict[str, Any]:
    """The torch CUDA allocator's allocated / reserved / peak bytes in this process and its GPU's UUID (empty on
    CPU); ``gpu_step_peak_bytes`` is the most it held since the last call (the step, read at its boundary:
    :func:`easytrain.memory.peaks.device_peak_since_read`)."""
    if not _cuda_in_use():
        return {}
    import torch

    from easytrain.memory.peaks import device_peak_since_read

    return {"gpu_allocated_bytes": int(torch.cuda.memory_allocated()),
            "gpu_reserved_bytes": int(torch.cuda.memory_reserved()),
            "gpu_peak_bytes": int(torch.cuda.max_memory_allocated()),
            "gpu_step_peak_bytes": device_peak_since_read(),
            "gpu_uuid": str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", ""))}


def release_process_memory() -> dict[str, Any]:
    """Give this process's free memory back: Python's garbage, torch's CUDA cache, glibc's free heap.

    Returns the bytes actually freed, measured (RSS before and after; on GPU the allocator's reserved
    bytes before and after), so nothing is claimed that did not happen.
    """
    import ctypes
    import gc

    pid = os.getpid()
    rss_before = process_rss(pid) or 0
    cuda = sys.modules["torch"].cuda if _cuda_in_use() else None
    reserved_before = cuda.memory_reserved() if cuda is not None else 0
    gc.collect()
    if cuda is not None:
        cuda.empty_cache()
    trimmed = False
    try:  # glibc keeps freed heap pages; malloc_trim returns them to the OS (RSS drops)
        trimmed = bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        pass
    rss_after = process_rss(pid) or 0
    reserved_after = cuda.memory_reserved() if cuda is not None else 0
    return {"pid": pid, "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
            "ram_freed_bytes": max(0, rss_before - rss_after),
            "gpu_freed_bytes": max(0, int(reserved_before - reserved_after)), "malloc_trim": trimmed}
