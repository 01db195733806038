"""What each worker call peaked at: host RSS and device memory per dispatched method, for the plan check.

Every method a worker group dispatches (:func:`easytrain.distributed.group.dispatch`) runs between
:func:`enter` and :func:`leave`. Entering resets the kernel's high-water mark of this process's resident set
(``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs``) and, on a GPU, torch's peak allocator
statistics; leaving reads both. The call's peak is therefore the most the process held at any instant of the
call, not a sample. Calls nest (a fused worker's ``update`` runs its actor's): before an inner
call resets the counters, the peak so far is folded into every enclosing call, so each call's figure covers its
whole span. Worker actors run one call at a time (no concurrency groups), which is what makes one process-wide
counter usable.

:func:`drain` returns and clears the peaks per method name since the last drain (the largest when a method ran
several times); :func:`lifetime_peak` the largest host peak of the process so far (``ru_maxrss`` no longer
says that once the counter is reset).
"""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")

_stack: list[list[float]] = []
"""One [host peak, device peak, start time] per call in progress, outermost first."""
_peaks: dict[str, list[Any]] = {}
"""Per method: host peak, device peak, first start and last end (epoch seconds) since the last drain, and the
resident set's kinds at the end of the call with the largest host peak (:func:`resident_kinds`)."""
_lifetime = [0, 0]
_since_read = [0]
"""The device peak since :func:`device_peak_since_read` last ran."""
_state = {"can_reset": True}


def _status(*fields: str) -> dict[str, int]:
    """``fields`` of ``/proc/self/status`` in bytes (the kernel writes them in kB); absent ones left out."""
    out = {}
    try:
        for line in STATUS.read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def host_high_water() -> int:
    """This process's resident-set high-water mark in bytes (``VmHWM``; 0 where /proc does not say)."""
    return _status("VmHWM").get("VmHWM", 0)


RESIDENT_KINDS = {"RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes", "RssShmem": "rss_shmem_bytes"}
"""What the resident set is made of (Linux): private memory (the heap, tensors), pages of mapped files (libraries,
a checkpoint read through mmap) and shared memory (on a Ray node, the object store's pages this process has
touched: batches received and results returned)."""


def resident_kinds() -> dict[str, int]:
    """This process's resident set now, by kind (:data:`RESIDENT_KINDS`; empty where /proc does not say)."""
    return {RESIDENT_KINDS[k]: v for k, v in _status(*RESIDENT_KINDS).items()}


def _cuda() -> Any:
    import torch

    return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _read() -> tuple[int, int]:
    cuda = _cuda()
    return host_high_water(), int(cuda.max_memory_allocated()) if cuda is not None else 0


def _reset() -> None:
    if _state["can_reset"]:
        try:
            CLEAR_REFS.write_text("5")
        except OSError as error:  # a kernel or sandbox without it: the peaks become lifetime peaks, said once
            _state["can_reset"] = False
            logger.warning("cannot reset the peak RSS (%s): per-call host peaks are the process's peaks so far",
                           error)
    cuda = _cuda()
    if cuda is not None:
        cuda.reset_peak_memory_stats()


def _fold(host: int, device: int) -> None:
    for frame in _stack:
        frame[0], frame[1] = max(frame[0], host), max(frame[1], device)
    _lifetime[0], _lifetime[1] = max(_lifetime[0], host), max(_lifetime[1], device)
    _since_read[0] = max(_since_read[0], device)


def device_peak_since_read() -> int:
    """The most device memory the allocator held since the last call (the watchdog's step peak): what the
    dispatched calls peaked at, and the counter now."""
    _fold(*_read())
    peak, _since_read[0] = _since_read[0], 0
    return int(peak)


def enter() -> None:
    """A dispatched call starts: what the enclosing calls peaked at so far is kept, the counters reset."""
    _fold(*_read())
    _reset()
    _stack.append([0, 0, time.time()])


def leave(name: str) -> None:
    """The call ``name`` ends: its peaks (host and device bytes) are recorded."""
    host, device = _read()
    end = time.time()
    frame = _stack.pop() if _stack else [0, 0, end]
    frame[0], frame[1] = max(frame[0], host), max(frame[1], device)
    _fold(host, device)
    seen = _peaks.setdefault(name, [0, 0, frame[2], end, {}])
    if frame[0] >= seen[0]:  # the call with the largest peak so far: what its resident set was made of at its end
        seen[4] = resident_kinds()
    seen[0], seen[1], seen[3] = max(seen[0], frame[0]), max(seen[1], frame[1]), end


def active() -> bool:
    """Whether a dispatched call is in progress in this process."""
    return bool(_stack)


_libc: list[Any] = []
M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (malloc.h)."""


def _glibc() -> Any:
    """The C library when it is glibc, else None."""
    if not _libc:
        try:
            _libc.append(ctypes.CDLL("libc.so.6"))
        except OSError:
            _libc.append(None)
    return _libc[0]


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve every host block of at least ``nbytes`` with its own mapping (``mallopt(M_MMAP_THRESHOLD)``), for
    the rest of the process: such a block returns to the OS when freed, so RSS follows the live tensors. Setting
    it also stops glibc from raising the threshold to the largest block freed (its dynamic default), which is what
    lets freed tensors of up to 32 MiB pile up in the heap. False where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))


def trim_heap() -> None:
    """Hand glibc's free heap pages back to the OS (``malloc_trim``). A worker's tensors below glibc's mmap
    threshold (most parameter shards, gradients and optimizer moments of a mid-sized model) live on the heap;
    freed, they stay resident, and the next phase's RSS keeps the last one's peak. Trimmed after each worker
    call, a process's RSS (what Ray's memory monitor reads, and the plan prices) follows its live tensors.
    Microseconds when little is free."""
    libc = _glibc()
    if libc is not None:  # not glibc: nothing to trim
        libc.malloc_trim(0)


def drain() -> dict[str, dict[str, float]]:
    """Per method since the last drain: peak host and device bytes, the first call's start and the last one's
    end (epoch seconds), and what the resident set of the call with the largest host peak was made of when it
    ended (:func:`resident_kinds`: a plan miss shows whether heap, mapped files or object-store pages grew)."""
    out = {name: {"host_bytes": int(host), "device_bytes": int(device), "start": start, "end": end, **kinds}
           for name, (host, device, start, end, kinds) in _peaks.items()}
    _peaks.clear()
    return out


def lifetime_peak() -> int:
    """The largest resident set this process has had (bytes), counting the calls' peaks and now."""
    _fold(*_read())
    return int(_lifetime[0])
