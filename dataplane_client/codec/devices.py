"""CUDA tensors in and out of the data plane: which device, and the copies to and from it.

- A put of a contiguous CUDA tensor keeps the tensor (``EncodedField.device_values``)
  until its bytes' destination is known. Same node, that is the unit's shared-memory
  region, and the bytes go device-to-host straight into it (:func:`copy_rows_to_host`,
  called by the transport); any other destination (a unit reached through Ray, the
  in-process store) takes them from ``require_values``, a plain ``.cpu()``. A
  non-contiguous CUDA tensor is copied to host memory when encoded, as before.
- A get with ``device=`` gathers each field's rows straight into one buffer on that
  device (:func:`gather_to_device`, from ``assembly.assemble_on``); same-node rows are
  read through this process's kept mapping of the unit's chunk (``shm.write_maps``).

A GPU copies at full speed only to and from pinned memory: from pageable memory the
driver bounces every byte through a pinned buffer of its own. So a process that moves
bytes to or from a GPU registers its kept mappings with CUDA (:func:`pin_kept_mappings`:
once per process; ``shm.KeptMaps`` registers each mapping once, as registering costs
about as much as a copy), issues every copy ``non_blocking`` and waits once at the end
(:func:`synchronize`).

Every CUDA call here sits behind a device check, so a CPU process never initialises
CUDA, and ``device="cpu"`` runs the same code as a GPU, minus the pinning: the CPU
tests cover it.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from typing import Any

import numpy as np
import torch

from dataplane_client.wire import shm
from dataplane_client.wire.encoded import EncodedField, row_byte_offsets, run_bounds
from dataplane_client.wire.errors import InvalidBatch

_DEVICE_HELP = "use None (host memory, as stored), 'cpu', 'cuda' or 'cuda:<index>'"


def parse_device(value: Any, what: str = "device") -> torch.device | None:
    """The device a get returns its tensors on (None: stays on the host, as today).

    InvalidBatch naming ``what`` for anything else than None, a str or a
    ``torch.device`` of a CPU or of a CUDA device this process sees.
    """
    if value is None:
        return None
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError):
            raise InvalidBatch(f"{what}={value!r} is not a device: {_DEVICE_HELP}") from None
    else:
        raise InvalidBatch(
            f"{what} must be a str or a torch.device, got {type(value).__name__}: {_DEVICE_HELP}"
        )
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidBatch(f"{what}={value!r}: a {device.type!r} device holds no data here")
    if not torch.cuda.is_available():
        raise InvalidBatch(f"{what}={value!r}: this process sees no CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise InvalidBatch(
            f"{what}={value!r}: this process sees {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def is_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


def synchronize(device: torch.device | None) -> None:
    """Wait for the copies issued on ``device``'s current stream (nothing to wait for on
    the host: its copies are done when issued)."""
    if is_cuda(device):
        torch.cuda.current_stream(device).synchronize()


# ---- pinning ------------------------------------------------------------------------------


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration: torch reads it
    after its next kernel launch and would raise it there, far from its cause."""
    try:
        ctypes.CDLL(None).cudaGetLastError()  # torch loads libcudart with RTLD_GLOBAL
    except (AttributeError, OSError):  # not visible here: the next launch may report it
        pass


class CudaRegistrar:
    """Pins host ranges with ``cudaHostRegister`` (torch's bindings of the CUDA runtime)."""

    def __init__(self) -> None:
        torch.cuda.init()
        self._cudart = torch.cuda.cudart()

    def register(self, addr: int, nbytes: int) -> bool:
        ok = int(self._cudart.cudaHostRegister(addr, nbytes, 0)) == 0  # 0: cudaHostRegisterDefault
        if not ok:
            _clear_cuda_error()  # the range stays pageable: copies still work, slower
        return ok

    def unregister(self, addr: int) -> None:
        if int(self._cudart.cudaHostUnregister(addr)) != 0:
            _clear_cuda_error()


_pinning_lock = threading.Lock()


def pin_kept_mappings(device: torch.device | None) -> None:
    """From now on this process's kept chunk mappings are pinned (a no-op off CUDA, and
    after the first call)."""
    if not is_cuda(device) or shm.write_maps.registrar is not None:
        return
    with _pinning_lock:
        if shm.write_maps.registrar is None:
            shm.write_maps.pin_with(CudaRegistrar())


# ---- copies -------------------------------------------------------------------------------


def host_tensor(values: np.ndarray) -> torch.Tensor:
    """A uint8 tensor viewing a 1-D byte array (read-only ones too: only copied from)."""
    if values.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(values)


def copy_rows_to_host(enc: EncodedField, rows: np.ndarray, out: np.ndarray) -> None:
    """``rows`` of a field whose bytes are on a device, back to back into ``out`` (host
    memory, e.g. a unit's region): one copy per run of adjacent rows, one wait."""
    src = enc.device_values
    if src is None:
        raise ValueError("copy_rows_to_host: this field's bytes are not on a device")
    pin_kept_mappings(src.device)
    offsets = row_byte_offsets(enc)
    rows = np.asarray(rows, dtype=np.int64)
    starts, ends = offsets[rows], offsets[rows + 1]
    first, last = run_bounds(starts, ends)
    dst, pos = host_tensor(out), 0
    for lo, hi in zip(starts[first].tolist(), ends[last].tolist()):
        dst[pos : pos + hi - lo].copy_(src[lo:hi], non_blocking=True)
        pos += hi - lo
    synchronize(src.device)


def gather_to_device(
    buffers: list[np.ndarray],
    which: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    device: torch.device,
) -> torch.Tensor:
    """Byte ranges of host ``buffers`` (range i of ``buffers[which[i]]``) back to back in
    one new uint8 buffer on ``device``: one copy per run of adjacent ranges of a buffer.

    Issued, not awaited on a GPU: the caller keeps the sources alive and calls
    :func:`synchronize` once after its last gather.
    """
    out = torch.empty(int((ends - starts).sum()), dtype=torch.uint8, device=device)
    first, last = run_bounds(starts, ends, which)
    pos, async_copy = 0, is_cuda(device)
    for w, lo, hi in zip(which[first].tolist(), starts[first].tolist(), ends[last].tolist()):
        out[pos : pos + hi - lo].copy_(host_tensor(buffers[w][lo:hi]), non_blocking=async_copy)
        pos += hi - lo
    return out
