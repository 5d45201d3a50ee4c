"""Files of a write: the dense source read, its side files (tokenizer, generation config) copied, and the result
published atomically: a temp directory next to the output, renamed into place, never left behind (SIGTERM
included); an existing output is replaced only when it holds nothing but checkpoint files."""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from .formats import WriterError

SKIP_FILES = {"config.json", "hf_quant_config.json", "quantization_config.json", "quantize_config.json",
               "recipe.yaml", "model.safetensors.index.json", "pytorch_model.bin.index.json",
               "hf_w4_converted.json"}   # hf_w4.tools.models' marker: it says "dequantized Q4_1 dense", not this file
# what an output directory may hold and still be replaced (see _check_target): the files write_checkpoint writes
# or copies from a source plus the usual files of a Hugging Face checkpoint; anything else is someone's data
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                     "quantize_config.json", "quantization_config.json", "hf_quant_config.json", "recipe.yaml",
                     "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                     "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.*",
                     "preprocessor_config.json", "processor_config.json", "README.md", "LICENSE*")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


def dump(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def load_dense(src: Path) -> nn.Module:
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a checkpoint directory")
    cfg_path = src / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{src}: no config.json")
    with open(cfg_path) as f:
        if "quantization_config" in json.load(f) or (src / "hf_quant_config.json").exists():
            raise WriterError(f"{src}: the source checkpoint is already quantized; a dense checkpoint is required")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)


def side_files(src: Path) -> List[Path]:
    """Tokenizer, generation config, chat template, ... (every top-level file that is not weights/config)."""
    return [f for f in sorted(src.iterdir()) if f.is_file() and not f.name.startswith(".")
            and f.name not in SKIP_FILES and not f.name.endswith(WEIGHT_SUFFIXES)]


def copy_side_files(src: Path, dst: Path) -> None:
    for f in side_files(src):
        if not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


def output_path(out_dir) -> Path:
    """A symlink is followed: the checkpoint is written (atomically) where it points and the link stays; renaming
    onto the link itself would replace the link, not the directory the user meant."""
    out = Path(out_dir).absolute()
    return Path(os.path.realpath(out)) if out.is_symlink() else out


def check_source(src: Optional[Path], out: Path) -> None:
    """The output may not be the source, inside it or around it: publishing replaces the whole directory."""
    if src is None or not src.is_dir():
        return
    s, o = os.path.realpath(src), os.path.realpath(out)
    if o == s:
        raise WriterError(f"{out}: the output directory is the source model {src}; writing would replace the "
                          "source: choose another output directory")
    if os.path.commonpath([s, o]) == s:
        raise WriterError(f"{out}: the output directory is inside the source model {src}; "
                          "choose a directory outside it")
    if os.path.commonpath([s, o]) == o:
        raise WriterError(f"{out}: the output directory contains the source model {src}; writing would delete "
                          "it: choose another output directory")


def check_target(out: Path, side: Sequence[str] = ()) -> None:
    """An existing ``out`` is replaced only if every entry in it is a file matching :data:`CHECKPOINT_FILES` or
    named like one of the source's side files the new checkpoint gets (``side``); otherwise it is refused,
    naming the other entries, so a user's notes, runs or a model cache are never deleted."""
    if out.exists() and not out.is_dir():
        raise WriterError(f"{out}: exists and is not a directory")
    if not out.is_dir():
        return
    other = sorted(e.name + ("/" if e.is_dir() else "") for e in out.iterdir()
                   if not (e.is_file() and (e.name in side
                                            or any(fnmatch.fnmatchcase(e.name, p) for p in CHECKPOINT_FILES))))
    if other:
        more = f" and {len(other) - 8} more" if len(other) > 8 else ""
        raise WriterError(f"{out}: exists and is not empty, and holds entries that are not checkpoint files: "
                          f"{other[:8]}{more}; refusing to replace it (move them away or choose another output "
                          "directory)")


def _umask() -> int:
    try:  # Linux: read it; setting and restoring it would briefly change it for every thread
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _open_permissions(tmp: Path) -> None:
    """mkdtemp makes the directory 0700 and safetensors writes 0600; a checkpoint gets the modes any file
    written by the user would (0777 / 0666 minus the umask), so others can load it where the umask allows."""
    mask = _umask()
    os.chmod(tmp, 0o777 & ~mask)
    for f in tmp.iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~mask)


class _Terminated(BaseException):
    """SIGTERM arrived while a checkpoint was being written (see :class:`_SigtermCleanup`)."""


class _SigtermCleanup:
    """SIGTERM's default action kills the process on the spot, leaving the temp directory (the size of the
    model) behind. While writing, the main thread turns SIGTERM into :class:`_Terminated`, so the ``except``
    clauses remove the temp dir; then the old handler is restored and the signal sent again, so the process
    still dies of SIGTERM. Only in the main thread (Python runs handlers there) and only if SIGTERM has its
    default action: a handler the application installed is left alone. ``hold()`` defers the signal over the
    renames that publish the directory, so it cannot land between them."""

    def __init__(self):
        self.active = False
        self.held = False
        self.pending = False

    def __enter__(self):
        self.active = (threading.current_thread() is threading.main_thread()
                       and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        if self.active:
            signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.held:
            self.pending = True
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second SIGTERM must not interrupt the cleanup
        raise _Terminated()

    @contextlib.contextmanager
    def hold(self):
        self.held = True
        try:
            yield
        finally:
            self.held = False
        if self.pending:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise _Terminated()

    def __exit__(self, typ, exc, tb):
        if not self.active:
            return False
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if typ is _Terminated:
            os.kill(os.getpid(), signal.SIGTERM)         # dies here, after the cleanup
            raise SystemExit(128 + signal.SIGTERM)       # SIGTERM blocked in every thread: exit as if killed
        return False


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished temp dir into place; an existing checkpoint there is replaced, never half-overwritten."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(old)
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    """``fill(tmp)`` writes the checkpoint into a temp directory next to ``out``, which then replaces ``out``; the
    temp directory never survives (an exception or SIGTERM removes it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with _SigtermCleanup() as term:
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            fill(tmp)
            _open_permissions(tmp)
            with term.hold():
                _publish(tmp, out)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
