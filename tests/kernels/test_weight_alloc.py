"""Packed weights in transparent huge pages (csrc/cpu/common/weight_alloc.h, ``ops.empty_weight``): from 2 MiB on
the repack ops and ``empty_weight`` allocate 2 MiB-aligned mappings marked for huge pages, freed with the tensor."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_w4 import ops

HUGE = 2 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_mode = THP.read_text() if THP.exists() else ""
needs_thp = pytest.mark.skipif(not thp_mode or "[never]" in thp_mode,
                               reason=f"no transparent huge pages on this machine ({thp_mode.strip() or 'not Linux'})")


def _mapping_of(addr: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding ``addr``: its range, sizes in kB and VmFlags."""
    entry = None
    for line in open("/proc/self/smaps"):
        key, _, rest = line.partition(" ")
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", key):
            if entry is not None:
                break
            lo, hi = (int(v, 16) for v in key.split("-"))
            entry = {"lo": lo, "hi": hi} if lo <= addr < hi else None
        elif entry is not None:
            vals = rest.split()
            entry[key.rstrip(":")] = vals if key == "VmFlags:" else int(vals[0])
    assert entry is not None, f"no mapping holds {addr:#x}"
    return entry


@needs_thp
def test_large_buffers_are_aligned_huge_page_mappings():
    t = ops.empty_weight((5 * HUGE + 12345,), torch.uint8)
    t.fill_(7)   # the first touch faults the huge pages in
    m = _mapping_of(t.data_ptr())
    assert t.data_ptr() % HUGE == 0 and m["lo"] == t.data_ptr(), m
    assert m["hi"] - m["lo"] == (t.numel() + 4095) // 4096 * 4096, "the mapping is the tensor, nothing around it"
    assert "hg" in m["VmFlags"], m    # marked MADV_HUGEPAGE
    assert m["AnonHugePages"] >= 2048, m   # at least one 2 MiB page of the 5 whole ones (the kernel may lack free ones)
    assert int(t.sum()) == 7 * t.numel()
    lo = m["lo"]
    del t
    assert all(not (a <= lo < b) for a, b in _anon_ranges()), "freed with the tensor"


def _anon_ranges():
    for line in open("/proc/self/maps"):
        a, b = (int(v, 16) for v in line.split()[0].split("-"))
        yield a, b


@needs_thp
def test_repack_outputs_and_small_buffers():
    from qweight_cases import make_qweight
    _, qw = make_qweight("gptq", 4096, 1024, 128)      # 2 MiB of packed codes
    q, s, z = ops.cpu_w4a16_repack(qw, None)
    assert q.data_ptr() % HUGE == 0 and "hg" in _mapping_of(q.data_ptr())["VmFlags"]
    assert s.numel() * s.element_size() < HUGE and s.data_ptr() % HUGE != 0   # 128 KiB of scales: torch's allocator
    small = ops.empty_weight((3, 5), torch.float16)
    assert small.shape == (3, 5) and small.dtype == torch.float16
    assert ops.empty_weight((0, 4), torch.int32).shape == (0, 4)


def test_switched_off_by_the_environment():
    code = ("import torch; from hf_w4 import ops; t = ops.empty_weight((3 << 21,), torch.uint8); "
            "print(t.data_ptr() % (2 << 20))")
    env = dict(os.environ, HF_W4_HUGE_PAGES="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) != 0, "torch's allocator: 64-byte, not 2 MiB, alignment"


@needs_thp
def test_huge_page_tensors_behave_as_ordinary_ones(tmp_path):
    """A layer's repacked buffers in huge pages: the checkpoint's codes come back from them (save_pretrained's path),
    and deepcopy, torch.save / load and share_memory_ work on them."""
    import copy
    from qweight_cases import make_qweight
    from hf_w4 import layouts
    from hf_w4.kernels.cpu_w4a16 import CpuW4A16Kernel
    spec, qw = make_qweight("gptq", 4096, 1024, 128)
    kern = CpuW4A16Kernel(spec, qw.n, qw.k)
    layer = torch.nn.Module()
    kern.prepare(layer, qw)
    q = layer.w4a16_qpack
    assert q.data_ptr() % HUGE == 0
    assert torch.equal(kern.unpack_codes(layer), layouts.unpack_codes(qw).to(torch.uint8))
    assert torch.equal(copy.deepcopy(q), q)
    torch.save(layer.state_dict(keep_vars=True) | {"q": q}, tmp_path / "q.pt")
    assert torch.equal(torch.load(tmp_path / "q.pt")["q"], q)
    ref = q.clone()
    q.share_memory_()
    assert q.is_shared() and torch.equal(q, ref)
