"""Load-time memory: the model is held once, not once plus the checkpoint's file pages and freed scratch.

Tensors still backed by a checkpoint file's memory map after loading get memory of their own. transformers 5 reads
safetensors through ``mmap``: every tensor it loads without a cast is a view of the file, and the whole map stays
(its touched pages counted in the process's RSS next to the model's own memory) as long as one such view lives.
Copying each view out with ``pread`` instead of through the map gives the model memory of its own without
faulting the mapped pages in, so the peak stays near the model's size; once the last view is replaced, the file is
unmapped. Linux only (the maps are found in ``/proc/self/maps``); elsewhere nothing is copied.

Repacking layer after layer frees scratch memory (copies of the code tensors, unpacked codes) that glibc's malloc
keeps for reuse in holes of its heaps rather than handing back; over a multi-GB model that grew the resident size by
a third. :func:`trim_heap` hands it back after each layer.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .. import ops


def _maps(paths: Iterable[str]) -> List[Tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's mappings of ``paths``."""
    want = {os.path.realpath(str(p)) for p in paths}
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].strip() in want:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    out.append((start, end, int(parts[2], 16), parts[5].strip()))
    except OSError:  # not Linux
        return []
    return out


def mapped(paths: Iterable[str]) -> List[str]:
    """Those of ``paths`` this process has mapped."""
    return sorted({m[3] for m in _maps(paths)})


class CheckpointMaps:
    """The mappings of a checkpoint's files; :meth:`copy_out` replaces the tensors that live in them."""

    def __init__(self, files: Iterable[str]):
        self.files = list(files or ())
        self.maps = _maps(self.files)
        self._fds: Dict[str, int] = {}
        self._copies: Dict[int, torch.UntypedStorage] = {}  # mapped storage address -> its copy (shared views)
        self._made: set = set()  # the copies' addresses: once a file is unmapped, new memory may take its place

    def _where(self, storage: torch.UntypedStorage) -> Optional[Tuple[str, int]]:
        p = storage.data_ptr()
        for start, end, off, path in self.maps:
            if start <= p < end:
                return path, off + p - start
        return None

    def _copy(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """``t`` on a copy of its storage read from the file, or None if it is not mapped from one."""
        # plain CPU tensors only: a tensor subclass (a tensor-parallel DTensor) has no storage of its own
        if not self.maps or type(t) is not torch.Tensor or t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
            return None
        s = t.untyped_storage()
        if s.data_ptr() in self._made:
            return None
        if s.data_ptr() not in self._copies:
            where = self._where(s)
            if where is None:
                return None
            path, offset = where
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            buf = ops.empty_weight((s.nbytes(),), torch.uint8)  # (huge pages: a dense LM head streams faster)
            view, done = memoryview(buf.numpy()), 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{path}: short read at byte {offset + done} while copying a tensor out of its map")
                done += n
            self._copies[s.data_ptr()] = buf.untyped_storage()
            self._made.add(buf.data_ptr())
        return torch.empty(0, dtype=t.dtype).set_(self._copies[s.data_ptr()], t.storage_offset(), t.shape, t.stride())

    def copy_out(self, module: nn.Module, recurse: bool = True) -> None:
        """Give every parameter and buffer of ``module`` that is a view of a checkpoint file memory of its own."""
        # read again: a file whose last view went is unmapped, and its addresses may now hold other memory
        self.maps, self._copies = _maps(self.files), {}
        if not self.maps:
            return
        for m in module.modules() if recurse else (module,):
            for name, p in list(m._parameters.items()):
                local = getattr(p, "_local_tensor", None)  # a tensor-parallel DTensor: its rank's tensor, in place
                if local is not None and (v := self._copy(local)) is not None:
                    local.set_(v)
                elif p is not None and (v := self._copy(p.data)) is not None:
                    p.data = v  # the same Parameter object: ties and optimizers' references hold
            for name, b in list(m._buffers.items()):
                if b is not None and (v := self._copy(b)) is not None:
                    if getattr(b, "_is_hf_initialized", False):  # transformers' mark of a loaded tensor
                        v._is_hf_initialized = True
                    m._buffers[name] = v

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._copies.clear()


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim() if os.name == "posix" else None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere)."""
    if _TRIM is not None:
        _TRIM(0)
