"""Write a dense Hugging Face causal LM as a 4-bit checkpoint, laid out exactly as the producer would.

    from hf_w4 import writers
    res = writers.write_checkpoint(model_or_dir, "out/ckpt", "gptq", group_size=128, sym=True)
    res.dense_weights["model.layers.0.mlp.up_proj"]   # exact fp32 weight the written codes/scales mean
    twin = res.dense_model()                          # nn.Linear-only fp32 copy with those weights

Quantization is round-to-nearest (RTN) per output row and K-group; no calibration. Layouts, tensor names,
dtypes and config keys follow the producers' real files (docs/formats.md). Bit packing is
:func:`hf_w4.layouts.pack`; this module only computes integer codes and scales and writes files.

Conventions (see :func:`quantize_rtn`):

* GPTQ / AWQ / auto-round int4, symmetric, zero 8. ``sym_scale="amax7"``: scale = amax/7, codes
  clamp(round(w/s), -8, 7) + 8 (default for ``gptq`` and ``awq``). ``sym_scale="signed"``: auto-round's signed
  scale, s = w[argmax |w|] / -8, so the largest-magnitude weight lands exactly on code -8 and about half the
  scales are negative (default for ``autoround`` / ``autoround-awq``, as real auto-round files are).
* compressed-tensors int4 symmetric: scale = amax / ((qmax - qmin)/2) = amax/7.5, q in -8..7, stored q+8.
* int8 (CT W8A8): scale = amax/127.5, q in -128..127. W4A8: amax/7.5, q in -8..7 one per int8.
* asymmetric int4 (every format): range widened to include 0, scale = (max-min)/15, zero =
  clamp(round(-min/scale), zmin, 15), codes clamp(round(w/s) + zero, 0, 15). zmin = 1 for GPTQ "v1" files
  (``gptq``, ``autoround`` auto_gptq packing) so the stored zero-1 never wraps; 0 elsewhere. CT stores the
  zero as zp = zero - 8 (+8 offset on disk), which is the same number.
* NVFP4, CT: global scale (a divisor) = bf16(448*6/amax), block scale = fp8(block_amax/6 * global);
  ModelOpt: weight_scale_2 (a multiplier) = fp32(amax/(6*448)), block scale = fp8(block_amax/(6*ws2)),
  block scales clamped to [2^-9, 448]; codes are E2M1 round-to-nearest (ties to even code).
* Scales are rounded to their on-disk dtype *before* the codes are computed; a scale that would round to 0
  becomes the dtype's smallest normal number. The dense oracle is (code - zero) * stored_scale in fp32
  (exact: small integers times fp16/bf16 values), e2m1 * fp8 * ws2, or e2m1 * fp8 / global (CT NVFP4).
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import layouts
from ..formats.spec import W4Spec
from ..loading import moe
from ..nn import plain_linear

__all__ = ["FORMATS", "WriteResult", "RTNResult", "WriterError", "write_checkpoint", "quantize_rtn"]

FORMATS: Dict[str, str] = {
    "gptq": "GPTQ v1 (quant_method gptq, as auto-round exports it): qweight [K/8,N], qzeros (zero-1), fp16 scales, g_idx",
    "autoround": "auto-round, packing_format auto_round:auto_gptq (GPTQ layout, zero-1, no g_idx), signed sym scales",
    "autoround-awq": "auto-round, packing_format auto_round:auto_awq (AWQ GEMM layout)",
    "awq": "AutoAWQ GEMM (quant_method awq, version gemm): qweight [K,N/8] in AWQ nibble order, fp16 scales",
    "ct-w4a16": "compressed-tensors pack-quantized int4 (group or channel, sym or asym), scales in the model dtype",
    "ct-w8a8": "compressed-tensors int-quantized int8 per-channel weights + dynamic per-token int8 activations",
    "ct-w4a8": "compressed-tensors int-quantized int4-in-int8 weights (group) + dynamic per-token int8 activations",
    "ct-nvfp4": "compressed-tensors nvfp4-pack-quantized (NVFP4A16): E2M1 + fp8 per-16 scales + fp32 global divisor",
    "modelopt-w4a16": "NVIDIA ModelOpt W4A16_NVFP4: E2M1 + fp8 per-16 scales + fp32 weight_scale_2 multiplier",
    "modelopt-nvfp4": "NVIDIA ModelOpt NVFP4 (W4A4): as modelopt-w4a16 plus static input_scale tensors",
}

# versions the written configs claim (the producer versions whose files these layouts were checked against)
AUTOROUND_VERSION = "0.16.1"
CT_VERSION = "0.19.0"
MODELOPT_VERSION = "0.47.0"

FP8_MAX = 448.0
FP8_MIN = 2.0 ** -9           # smallest positive float8_e4m3fn (subnormal)
E2M1_MAX = 6.0
_GPTQ_FAMILY = ("gptq", "autoround", "autoround-awq", "awq")
_CT = ("ct-w4a16", "ct-w8a8", "ct-w4a8", "ct-nvfp4")
_MODELOPT = ("modelopt-w4a16", "modelopt-nvfp4")
_NVFP4 = ("ct-nvfp4",) + _MODELOPT
_CHECKPOINT_FORMATS = {"gptq": True, "gptq_v1": True, "gptq_v2": False}  # -> stores zero-1
_SKIP_FILES = {"config.json", "hf_quant_config.json", "quantization_config.json", "quantize_config.json",
               "recipe.yaml", "model.safetensors.index.json", "pytorch_model.bin.index.json",
               "hf_w4_converted.json"}   # hf_w4.tools.models' marker: it says "dequantized Q4_1 dense", not this file
# what an output directory may hold and still be replaced (see _check_target): the files write_checkpoint writes
# or copies from a source plus the usual files of a Hugging Face checkpoint; anything else is someone's data
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                     "quantize_config.json", "quantization_config.json", "hf_quant_config.json", "recipe.yaml",
                     "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                     "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.*",
                     "preprocessor_config.json", "processor_config.json", "README.md", "LICENSE*")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


class WriterError(ValueError):
    """A format/option/model combination the producer cannot write; names module, shape and supported values."""


# ----------------------------------------------------------------------------------------------
# RTN quantization of one matrix


@dataclass
class RTNResult:
    """One matrix quantized: the inputs of :func:`hf_w4.layouts.pack` plus the exact dense weight.

    ``codes`` [N, K]: int4 unsigned 0..15 (dense = (code - zero) * scale); int8 signed; nvfp4 E2M1 codes.
    ``scales`` [N, G] float32 holding the *stored* values (already rounded to ``scale_dtype``); nvfp4:
    float32 [N, K/16] holding fp8 values. ``zeros`` [N, G] int64 true zero points (None = 8, symmetric).
    ``global_scale``: nvfp4 only, in the file's convention (CT divisor, ModelOpt multiplier).
    """

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    group_size: int
    scale_dtype: torch.dtype
    global_scale: Optional[float] = None
    g_idx: Optional[torch.Tensor] = None

    def dense(self) -> torch.Tensor:
        """The exact fp32 weight these codes and stored scales represent (independent of the loader)."""
        return _dequant(self)


def _round_scale(s: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    r = s.to(dtype)
    if not bool(torch.isfinite(r).all()):
        raise WriterError(f"{what}: a scale overflows {str(dtype).replace('torch.', '')} "
                          f"(max |scale| = {s.abs().max().item():.4g}); the weights are too large for this format")
    r = torch.where(r == 0, torch.tensor(torch.finfo(dtype).tiny, dtype=dtype), r)
    return r.to(torch.float32)


def _grouped(w: torch.Tensor, gs: int) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n, k // gs, gs)


def quantize_rtn(w: torch.Tensor, kind: str = "int4", group_size: Optional[int] = 128, sym: bool = True, *,
                 sym_scale: str = "amax7", zero_min: int = 0, scale_dtype: torch.dtype = torch.float16,
                 g_idx: Optional[torch.Tensor] = None, name: str = "<weight>") -> RTNResult:
    """Round-to-nearest quantization of ``w`` [N, K] per output row and K-group.

    ``kind``: ``"int4"`` (GPTQ/AWQ/auto-round conventions, ``sym_scale`` "amax7" or "signed"), ``"ct-int4"``
    (compressed-tensors, sym scale amax/7.5), ``"int8"`` (amax/127.5), ``"int4in8"`` (CT W4A8: amax/7.5,
    signed codes), ``"nvfp4-ct"``, ``"nvfp4-modelopt"``. ``group_size`` -1/None = one group over K.
    ``g_idx`` [K] (act-order): column k belongs to group g_idx[k]; groups must all hold group_size columns.
    """
    w = w.detach().to(torch.float32)
    n, k = w.shape
    if kind in ("nvfp4-ct", "nvfp4-modelopt"):
        return _quantize_nvfp4(w, kind, name)
    gs = k if group_size in (None, 0, -1) else int(group_size)
    if gs <= 0 or k % gs:
        raise WriterError(f"{name}: K={k} is not divisible by group_size={group_size}")
    perm = None
    if g_idx is not None:
        perm = layouts.act_order_perm(g_idx, gs)
    wp = w[:, perm] if perm is not None else w
    x = _grouped(wp, gs)
    zeros = None
    if kind in ("int8", "int4in8"):
        if not sym:
            raise WriterError(f"{name}: {kind} weights are symmetric only")
        qmax = 127 if kind == "int8" else 7
        s = _round_scale(x.abs().amax(-1) / (qmax + 0.5), scale_dtype, name)
        q = torch.clamp(torch.round(x / s.unsqueeze(-1)), -qmax - 1, qmax)
    elif kind in ("int4", "ct-int4"):
        if sym:
            if kind == "ct-int4":
                s = x.abs().amax(-1) / 7.5
            elif sym_scale == "amax7":
                s = x.abs().amax(-1) / 7.0
            elif sym_scale == "signed":
                idx = x.abs().argmax(-1, keepdim=True)
                s = torch.gather(x, -1, idx).squeeze(-1) / -8.0
            else:
                raise WriterError(f"sym_scale={sym_scale!r} is not supported; supported: 'amax7', 'signed'")
            s = _round_scale(s, scale_dtype, name)
            q = torch.clamp(torch.round(x / s.unsqueeze(-1)), -8, 7) + 8
        else:
            lo = x.amin(-1).clamp(max=0)
            hi = x.amax(-1).clamp(min=0)
            s = _round_scale((hi - lo) / 15.0, scale_dtype, name)
            z = torch.clamp(torch.round(-lo / s), zero_min, 15)
            q = torch.clamp(torch.round(x / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)
            zeros = z.to(torch.int64)
    else:
        raise WriterError(f"unknown quantization kind {kind!r}; supported: int4, ct-int4, int8, int4in8, "
                          "nvfp4-ct, nvfp4-modelopt")
    codes = q.reshape(n, k).to(torch.int64)
    if perm is not None:
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(k)
        codes = codes[:, inv]
    return RTNResult(kind, codes, s, zeros, gs, scale_dtype, None,
                     None if g_idx is None else g_idx.to(torch.int64))


def _quantize_nvfp4(w: torch.Tensor, kind: str, name: str) -> RTNResult:
    n, k = w.shape
    if k % 16:
        raise WriterError(f"{name}: NVFP4 needs K divisible by 16, got K={k}")
    amax = float(w.abs().max().clamp(min=1e-12))
    ba = _grouped(w, 16).abs().amax(-1)
    if kind == "nvfp4-ct":
        # CT computes the global scale 448*6/amax in bf16 and stores it as fp32 (a divisor)
        g = float(torch.tensor(FP8_MAX * E2M1_MAX / amax).to(torch.bfloat16).float())
        if not (g > 0 and g < float("inf")):
            raise WriterError(f"{name}: NVFP4 global scale {g} is not finite (amax={amax:.4g})")
        bs = (ba / E2M1_MAX * g).clamp(FP8_MIN, FP8_MAX).to(layouts.FP8).to(torch.float32)
        x = _grouped(w, 16) * g / bs.unsqueeze(-1)
    else:
        g = float(torch.tensor(amax / (E2M1_MAX * FP8_MAX), dtype=torch.float32))
        bs = (ba / (E2M1_MAX * g)).clamp(FP8_MIN, FP8_MAX).to(layouts.FP8).to(torch.float32)
        x = _grouped(w, 16) / (bs.unsqueeze(-1) * g)
    codes = e2m1_codes(x.reshape(n, k))
    return RTNResult(kind, codes, bs, None, 16, layouts.FP8, g)


_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Same result as :func:`hf_w4.layouts.e2m1_encode` (nearest E2M1 value, ties to the even code, int64),
    vectorized with ``bucketize`` instead of an 8-way distance table: that one needs ~3 us per weight, i.e.
    minutes for a 135M-parameter model. Equality with ``e2m1_encode`` is checked in tests/test_writers.py."""
    a = x.abs().to(torch.float32).clamp(max=E2M1_MAX).contiguous()
    code = torch.bucketize(a, _E2M1_MIDPOINTS)          # a == midpoint -> the lower code
    tie = (code < 7) & (a == _E2M1_MIDPOINTS[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + tie.to(code.dtype)
    return code | (((x < 0) & (code > 0)).to(code.dtype) << 3)


def _dequant(r: RTNResult) -> torch.Tensor:
    n, k = r.codes.shape
    if r.kind.startswith("nvfp4"):
        v = torch.tensor(layouts.E2M1_VALUES, dtype=torch.float32)[r.codes] * r.scales.repeat_interleave(16, 1)
        g = torch.tensor(r.global_scale, dtype=torch.float32)
        return v / g if r.kind == "nvfp4-ct" else v * g
    gi = r.g_idx if r.g_idx is not None else torch.arange(k) // r.group_size
    s = r.scales[:, gi]
    if r.kind in ("int8", "int4in8"):
        return r.codes.to(torch.float32) * s
    z = 8.0 if r.zeros is None else r.zeros[:, gi].to(torch.float32)
    return (r.codes.to(torch.float32) - z) * s


# ----------------------------------------------------------------------------------------------
# result


@dataclass
class WriteResult:
    """What :func:`write_checkpoint` wrote.

    ``dense_weights``: module name -> the exact fp32 dense weight of every quantized Linear, computed from the
    integer codes and the stored (dtype-rounded) scales, not read back from the files. ``skipped``: module
    name -> why it was left dense (ignored, extra_config, incompatible shape, outside the quantized blocks).
    ``quantization_config``: the dict written (config.json / hf_quant_config.json).
    """

    path: str
    fmt: str
    quantized: List[str]
    skipped: Dict[str, str]
    quantization_config: dict
    _rtn: Dict[str, RTNResult] = field(repr=False, default_factory=dict)
    _other: Dict[str, torch.Tensor] = field(repr=False, default_factory=dict)   # every other tensor, as written
    _model_cls: type = field(repr=False, default=None)
    _config: object = field(repr=False, default=None)
    _dense: Optional[Dict[str, torch.Tensor]] = field(repr=False, default=None)

    @property
    def dense_weights(self) -> Dict[str, torch.Tensor]:
        if self._dense is None:
            self._dense = {name: r.dense() for name, r in self._rtn.items()}
        return self._dense

    def dense_state_dict(self) -> Dict[str, torch.Tensor]:
        """A full fp32 state dict of the dense twin: quantized weights from :attr:`dense_weights`, every other
        tensor exactly as written (rounded to the written dtype) then widened to fp32."""
        sd = {k: v.to(torch.float32) for k, v in self._other.items()}
        for name, w in self.dense_weights.items():
            sd[name + ".weight"] = w.clone()
        return sd

    def dense_model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The dense twin: the source architecture with plain ``nn.Linear`` modules holding the dense weights."""
        cfg = copy.deepcopy(self._config)
        for attr in ("quantization_config",):
            if hasattr(cfg, attr):
                delattr(cfg, attr)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            model = self._model_cls(cfg)
        finally:
            torch.set_default_dtype(prev)
        moe.unfuse_all(model)   # written one Linear per expert projection (write_checkpoint)
        sd = self.dense_state_dict()
        own = model.state_dict()
        for key in own:  # tied weights (lm_head sharing the embedding) are not written separately
            if key not in sd:
                src = _tied_source(model, key)
                if src is not None and src in sd:
                    sd[key] = sd[src]
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"dense twin: missing {missing}, unexpected {unexpected}")
        return model.to(dtype).eval()


def _tied_source(model: nn.Module, key: str) -> Optional[str]:
    ptr = model.state_dict()[key].data_ptr()
    for k, v in model.state_dict().items():
        if k != key and v.data_ptr() == ptr:
            return k
    return None


# ----------------------------------------------------------------------------------------------
# planning


@dataclass
class _Plan:
    name: str
    n: int
    k: int
    spec: Optional[W4Spec]          # None = dense
    kind: str = ""
    group_size: int = -1
    sym: bool = True
    zero_min: int = 0
    reason: str = ""
    in_block: bool = True


def _match(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if name == pattern or name.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def _check_ignore(ignore: Sequence[str], names: Sequence[str], lm_name: str, quantize_lm_head: bool) -> None:
    """A pattern that matches nothing is almost always a typo (``down_porj``) that would silently quantize
    the module the user wanted dense; ignoring lm_head while asking to quantize it is a contradiction."""
    unmatched = [p for p in ignore if not any(_match(p, n) for n in names)]
    if unmatched:
        eg = names[:3] + names[-2:] if len(names) > 5 else list(names)
        raise WriterError(f"ignore pattern(s) {unmatched} match no Linear module; modules are named like {eg} "
                          "(a pattern is a full name, a dotted suffix such as 'mlp.down_proj', or a regex: "
                          "'re:' prefix or full match)")
    if quantize_lm_head:
        hit = [p for p in ignore if _match(p, lm_name)]
        if hit:
            raise WriterError(f"quantize_lm_head=True (--lm-head) and ignore pattern(s) {hit} both name {lm_name}; "
                              "drop one of them")


def _norm_group(group_size) -> int:
    if group_size in (None, 0, -1):
        return -1
    g = int(group_size)
    if g <= 0:
        raise WriterError(f"group_size={group_size} is invalid; supported: a positive group size or -1/None "
                          "(one group per output channel)")
    return g


def _find_blocks(model: nn.Module, linears: Sequence[str]) -> Optional[str]:
    """Name of the ModuleList holding the decoder layers (the one with the most Linear descendants)."""
    best, count = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name:
            c = sum(1 for l in linears if l.startswith(name + "."))
            if c > count:
                best, count = name, c
    return best


def _layout_problem(fmt: str, layout: str, n: int, k: int, gs: int, sym: bool) -> Optional[str]:
    """Why this module cannot be written in ``layout`` (None if it can)."""
    if layout in ("ct_nvfp4", "modelopt_nvfp4"):
        return None if k % 16 == 0 else "NVFP4 needs K divisible by 16"
    g = k if gs == -1 else gs
    probs = []
    if k % g:
        probs.append(f"K is not divisible by group_size={gs}")
    if layout == "gptq" and (k % 8 or n % 8):
        probs.append("GPTQ packing needs N and K divisible by 8")
    if layout == "awq" and n % 8:
        probs.append("AWQ packing needs N divisible by 8")
    if layout == "ct_pack" and (k % 8 or (not sym and n % 8)):
        probs.append("pack-quantized needs K (and N when asymmetric) divisible by 8")
    return "; ".join(probs) or None


def _supported_groups(fmt: str, k: int) -> str:
    fits = [g for g in (32, 64, 128, 256) if k % g == 0]
    if fmt not in ("awq", "autoround-awq"):
        fits.append(-1)
    return f"group sizes that fit K={k}: {fits}" if fits else f"no group size in [32, 64, 128, 256] divides K={k}"


# ----------------------------------------------------------------------------------------------
# the writer


def write_checkpoint(model_or_dir, out_dir, fmt: str, *, group_size: Optional[int] = 128, sym: bool = True,
                     quantize_lm_head: bool = False, ignore: Iterable[str] = (), dtype: torch.dtype = torch.bfloat16,
                     desc_act: bool = False, checkpoint_format: Optional[str] = None,
                     extra_config: Optional[dict] = None, hf_quant_config_only: bool = False, seed: int = 0,
                     skip_incompatible: bool = False, sym_scale: Optional[str] = None,
                     block_name_to_quantize: Optional[Union[str, Sequence[str]]] = None,
                     input_amax: Optional[Union[float, Dict[str, float]]] = None) -> WriteResult:
    """Quantize (RTN) a dense causal LM and write it to ``out_dir`` in format ``fmt`` (one of :data:`FORMATS`).

    ``model_or_dir``: a ``PreTrainedModel`` (not modified) or a directory with a dense safetensors checkpoint
    (its tokenizer/generation files are copied). ``group_size``: K-group (-1/None = per channel; ignored by
    ``ct-w8a8``, which is always per channel, and by the NVFP4 formats, always 16). ``ignore``: module names,
    suffixes or regexes (``re:`` prefix or a full-match regex) left dense and listed in the config.
    ``quantize_lm_head``: also quantize lm_head (tied embeddings are untied: a separate lm_head is written).
    ``desc_act`` (gptq): act-order, a seeded random permutation g_idx with equal groups.
    ``checkpoint_format`` (gptq): None (v1, key omitted like the real files), "gptq_v1" or "gptq_v2" (no -1).
    ``extra_config`` (autoround*): per-module overrides ``{name: {"bits": 16}}`` (dense) or
    ``{"group_size": .., "sym": ..}``. ``hf_quant_config_only`` (modelopt*): no quantization_config in config.json.
    ``skip_incompatible``: leave modules whose shape the format cannot hold dense (listed as the producer
    would) instead of raising. ``sym_scale``: "amax7" or "signed" for the GPTQ/AWQ/auto-round int4 formats.
    ``block_name_to_quantize``: decoder-block prefix(es) for gptq/awq/auto-round (default: detected).
    ``input_amax`` (modelopt-nvfp4): activation amax (one float or per module) for ``input_scale``; default:
    measured on one forward pass of seeded random tokens.
    Everything not quantized is saved in ``dtype``. ``ignore`` patterns that match no Linear, or one that
    matches lm_head together with ``quantize_lm_head``, raise :class:`WriterError`.

    Output: the directory appears atomically (temp dir next to it + rename), with the modes the umask gives
    (0777/0666 minus it). If ``out_dir`` is a symlink, the checkpoint is written where it points. It may not
    be the source directory (or the directory a model object was loaded from), inside it or around it. An
    existing ``out_dir`` is replaced whole, but only if every entry in it is a checkpoint file (a name in
    :data:`_CHECKPOINT_FILES`, e.g. config.json, *.safetensors, tokenizer files, the quantization side
    configs, README.md) or one of the source's side files the new checkpoint gets; otherwise
    :class:`WriterError` names the other entries and nothing is touched. SIGTERM while the files are written
    (main thread, default SIGTERM action) removes the temp dir before the process dies of the signal.
    """
    if fmt not in FORMATS:
        raise WriterError(f"unknown format {fmt!r}; supported: {list(FORMATS)}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise WriterError(f"dtype={dtype!r} is not supported; supported: torch.bfloat16, torch.float16, torch.float32")
    opts = _check_options(fmt, group_size, sym, quantize_lm_head, desc_act, checkpoint_format, extra_config,
                          hf_quant_config_only, sym_scale)
    out = _output_path(out_dir)
    src_dir, side = None, ()
    if isinstance(model_or_dir, (str, os.PathLike)):
        src_dir = Path(model_or_dir)
        side = [f.name for f in _side_files(src_dir)] if src_dir.is_dir() else []
        _check_source(src_dir, out)          # before loading: a wrong output should not cost a model load
        _check_target(out, side)
        model = _load_dense(src_dir)
    elif isinstance(model_or_dir, nn.Module):
        model = model_or_dir
        if getattr(model.config, "quantization_config", None) is not None:
            raise WriterError("the source model is already quantized (its config has a quantization_config); "
                              "a dense model is required")
        origin = getattr(model, "name_or_path", "") or ""   # the directory it was loaded from, if any
        _check_source(Path(origin) if origin else None, out)
        _check_target(out)
    else:
        raise WriterError(f"model_or_dir must be a PreTrainedModel or a checkpoint directory, got {type(model_or_dir)}")

    # MoE experts fused into 3-D parameters (transformers 5) are quantized one Linear per expert projection,
    # under the per-expert names the producers write (hf_w4.loading.moe)
    with moe.unfused(model):
        ignore = tuple(ignore or ())
        linears = [(n, m) for n, m in model.named_modules() if plain_linear(m)]
        names = [n for n, _ in linears]
        mods = dict(model.named_modules())
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        lm_name = next((n for n, m in model.named_modules() if out_emb is not None and m is out_emb), "lm_head")
        _check_ignore(ignore, names, lm_name, opts["quantize_lm_head"])
        emb_name = next((n for n, m in model.named_modules() if in_emb is not None and m is in_emb), "model.embed_tokens")
        tied = (out_emb is not None and in_emb is not None and out_emb.weight.data_ptr() == in_emb.weight.data_ptr())
        if isinstance(block_name_to_quantize, str):
            blocks = tuple(b.strip() for b in block_name_to_quantize.split(",") if b.strip())
        elif block_name_to_quantize:
            blocks = tuple(block_name_to_quantize)
        else:
            b = _find_blocks(model, [n for n in names if n != lm_name])
            blocks = (b,) if b else ()
        plans = _plan(fmt, opts, linears, lm_name, blocks, ignore, skip_incompatible, extra_config)

        # ---------------------------------------------------------------- quantize (before touching the disk)
        tensors: Dict[str, torch.Tensor] = {}
        rtn: Dict[str, RTNResult] = {}
        gen = torch.Generator().manual_seed(int(seed))
        amax_in = _input_amax(model, plans, input_amax, seed) if fmt == "modelopt-nvfp4" else {}
        for p in plans.values():
            if p.spec is None:
                continue
            mod = mods[p.name]
            w = mod.weight.detach().to("cpu", torch.float32)
            g_idx = None
            if opts["desc_act"] and p.group_size != -1:
                perm = torch.randperm(p.k, generator=gen)
                g_idx = torch.empty(p.k, dtype=torch.int64)
                g_idx[perm] = torch.arange(p.k) // p.group_size
            r = quantize_rtn(w, p.kind, p.group_size, p.sym, sym_scale=opts["sym_scale"], zero_min=p.zero_min,
                             scale_dtype=_scale_dtype(fmt, dtype), g_idx=g_idx, name=f"{fmt}: {p.name}")
            if p.spec.layout == "gptq" and p.spec.has_g_idx and g_idx is None:
                r.g_idx = torch.arange(p.k) // (p.k if p.group_size == -1 else p.group_size)
            rtn[p.name] = r
            packed = layouts.pack(p.spec, r.codes, r.scales, r.zeros, r.global_scale, r.g_idx,
                                  scale_dtype=r.scale_dtype if r.scale_dtype != layouts.FP8 else None)
            layouts.declare(p.spec, p.n, p.k, p.name)  # final guard: the loader's view of the layout
            for t, v in packed.items():
                tensors[f"{p.name}.{t}"] = v.contiguous()
            if fmt == "modelopt-nvfp4":
                tensors[f"{p.name}.input_scale"] = torch.tensor(amax_in[p.name] / (E2M1_MAX * FP8_MAX), dtype=torch.float32)
            if mod.bias is not None:
                tensors[f"{p.name}.bias"] = mod.bias.detach().to("cpu", dtype).contiguous()

        # every other tensor in the model dtype; a tied lm_head is dropped unless it was quantized (untied)
        other: Dict[str, torch.Tensor] = {}
        seen: Dict[int, str] = {}
        quantized_weights = {f"{n}.weight" for n in rtn}
        untie = tied and lm_name in rtn
        for key, v in model.state_dict().items():
            if key in quantized_weights:
                continue
            if key.rsplit(".", 1)[0] in rtn and key.endswith(".bias"):
                other[key] = tensors[key]
                continue
            ptr = v.data_ptr()
            if ptr in seen and v.numel() > 0:
                continue  # shared storage (tied): written once, under its first name
            seen[ptr] = key
            t = v.detach().to("cpu")
            t = t.to(dtype) if t.is_floating_point() else t
            other[key] = t.contiguous().clone()
            tensors[key] = other[key]

    # ---------------------------------------------------------------- configs
    qcfg = _quant_config(fmt, opts, plans, lm_name, emb_name, blocks, extra_config, dtype)
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    if untie:
        cfg.tie_word_embeddings = False
        tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if tc is not cfg:
            tc.tie_word_embeddings = False
    cfg.dtype = dtype

    # ---------------------------------------------------------------- files (atomically)
    _check_target(out, side)   # again: the directory may have changed while the model was quantized
    out.parent.mkdir(parents=True, exist_ok=True)
    disk = _disk_name(model)   # the layout transformers' save_pretrained writes (e.g. Mixtral's block_sparse_moe)
    tensors = {disk(k): v for k, v in tensors.items()}
    with _SigtermCleanup() as term:
        _write_files(out, term, tensors, cfg, qcfg, fmt, hf_quant_config_only, src_dir, model)

    twin_cfg = copy.deepcopy(cfg)
    return WriteResult(path=str(out), fmt=fmt, quantized=list(rtn),
                       skipped={p.name: p.reason for p in plans.values() if p.spec is None and p.reason},
                       quantization_config=qcfg, _rtn=rtn, _other=other, _model_cls=type(model), _config=twin_cfg)


def _disk_name(model: nn.Module):
    """key -> the name transformers' ``save_pretrained`` stores it under: the model's renamings reversed, as it saves
    (Mixtral's ``mlp`` -> ``block_sparse_moe``, Llava's ``model.language_model`` -> ``language_model.model``). The
    quantization config keeps the model's module names, as a producer running on transformers 5 writes them (the
    loader matches a config against both)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
        renamings = [t.reverse_transform() for t in get_model_conversion_mapping(model, add_legacy=False)[::-1]
                     if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError, TypeError):
        return lambda k: k
    return (lambda k: apply_renamings(k, renamings)) if renamings else (lambda k: k)


def _write_files(out: Path, term: "_SigtermCleanup", tensors, cfg, qcfg, fmt, hf_quant_config_only, src_dir,
                 model) -> None:
    """Everything into a temp dir next to ``out``, then renamed into place; the temp dir never survives."""
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        from safetensors.torch import save_file
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(str(tmp))
        with open(tmp / "config.json") as f:
            cj = json.load(f)
        cj.pop("quantization_config", None)
        if fmt in _MODELOPT:
            hq = {"producer": {"name": "modelopt", "version": MODELOPT_VERSION},
                  "quantization": {"quant_algo": qcfg["quant_algo"], "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": list(qcfg["ignore"])}}
            _dump(tmp / "hf_quant_config.json", hq)
        if not (fmt in _MODELOPT and hf_quant_config_only):
            cj["quantization_config"] = qcfg
        _dump(tmp / "config.json", cj)
        if fmt.startswith("autoround"):
            _dump(tmp / "quantization_config.json", qcfg)
        if fmt == "gptq":
            _dump(tmp / "quantize_config.json", qcfg)   # auto-round's gptq export writes it too (source only)
        if fmt in _CT:
            (tmp / "recipe.yaml").write_text(_recipe(fmt, qcfg))
        if src_dir is not None:
            _copy_side_files(src_dir, tmp)
        elif getattr(model, "generation_config", None) is not None and not (tmp / "generation_config.json").exists():
            try:
                model.generation_config.save_pretrained(str(tmp))
            except Exception:  # noqa: BLE001 - an odd generation config must not stop the checkpoint
                pass
        _open_permissions(tmp)
        with term.hold():
            _publish(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_options(fmt, group_size, sym, quantize_lm_head, desc_act, checkpoint_format, extra_config,
                   hf_quant_config_only, sym_scale) -> dict:
    gs = _norm_group(group_size)
    if fmt == "ct-w8a8" or fmt in _NVFP4:
        gs = -1 if fmt == "ct-w8a8" else 16
    if fmt in ("awq", "autoround-awq") and gs == -1:
        raise WriterError(f"{fmt}: group_size={group_size} (per channel) is not supported by the AWQ GEMM layout; "
                          "supported: a positive group size such as 32, 64 or 128")
    if not sym and (fmt in ("ct-w8a8", "ct-w4a8") or fmt in _NVFP4):
        raise WriterError(f"{fmt}: sym=False is not supported; {fmt} weights are symmetric only (supported: sym=True)")
    if desc_act and fmt != "gptq":
        raise WriterError(f"{fmt}: desc_act=True is only supported for 'gptq' (act-order g_idx)")
    if checkpoint_format is not None and fmt != "gptq":
        raise WriterError(f"{fmt}: checkpoint_format is a gptq option; supported formats: ['gptq']")
    if checkpoint_format is not None and checkpoint_format not in _CHECKPOINT_FORMATS:
        raise WriterError(f"gptq: checkpoint_format={checkpoint_format!r} is not supported; "
                          f"supported: None, {sorted(_CHECKPOINT_FORMATS)}")
    if extra_config and not fmt.startswith("autoround"):
        raise WriterError(f"{fmt}: extra_config is an auto-round option; supported formats: autoround, autoround-awq")
    if hf_quant_config_only and fmt not in _MODELOPT:
        raise WriterError(f"{fmt}: hf_quant_config_only is a ModelOpt option; supported formats: {list(_MODELOPT)}")
    if quantize_lm_head and fmt == "awq":
        raise WriterError("awq: quantize_lm_head=True is not supported (AutoAWQ keeps lm_head in "
                          "modules_to_not_convert); supported: gptq, autoround*, ct-*, modelopt-*")
    if sym_scale is None:
        sym_scale = "signed" if fmt.startswith("autoround") else "amax7"
    if sym_scale not in ("amax7", "signed"):
        raise WriterError(f"sym_scale={sym_scale!r} is not supported; supported: 'amax7', 'signed'")
    if sym_scale == "signed" and fmt not in _GPTQ_FAMILY:
        raise WriterError(f"{fmt}: sym_scale='signed' applies to gptq/awq/auto-round only")
    v1 = fmt == "autoround" or (fmt == "gptq" and _CHECKPOINT_FORMATS.get(checkpoint_format or "gptq", True))
    return dict(group_size=gs, sym=bool(sym), quantize_lm_head=bool(quantize_lm_head), desc_act=bool(desc_act),
                checkpoint_format=checkpoint_format, sym_scale=sym_scale, v1=v1, group_arg=group_size)


def _spec_for(fmt: str, opts: dict, gs: int, sym: bool, v1: bool) -> Tuple[W4Spec, str, int]:
    """-> (W4Spec, quantize_rtn kind, zero_min)"""
    if fmt == "gptq":
        return (W4Spec("gptq", "gptq", "int4", 4, gs, sym, zero_plus_one=v1, has_g_idx=True,
                       desc_act=opts["desc_act"]), "int4", 1 if v1 else 0)
    if fmt == "autoround":
        return W4Spec("auto-round", "gptq", "int4", 4, gs, sym, zero_plus_one=True), "int4", 1
    if fmt == "autoround-awq":
        return W4Spec("auto-round", "awq", "int4", 4, gs, sym), "int4", 0
    if fmt == "awq":
        return W4Spec("awq", "awq", "int4", 4, gs, sym), "int4", 0
    if fmt == "ct-w4a16":
        return W4Spec("compressed-tensors", "ct_pack", "int4", 4, gs, sym), "ct-int4", 0
    if fmt == "ct-w8a8":
        return W4Spec("compressed-tensors", "ct_int", "int8", 8, -1, True, act="int8_token"), "int8", 0
    if fmt == "ct-w4a8":
        return W4Spec("compressed-tensors", "ct_int", "int8", 4, gs, True, act="int8_token"), "int4in8", 0
    if fmt == "ct-nvfp4":
        return W4Spec("compressed-tensors", "ct_nvfp4", "nvfp4", 4, 16, True), "nvfp4-ct", 0
    return (W4Spec("modelopt", "modelopt_nvfp4", "nvfp4", 4, 16, True, has_input_scale=fmt == "modelopt-nvfp4"),
            "nvfp4-modelopt", 0)


def _plan(fmt, opts, linears, lm_name, blocks, ignore, skip_incompatible, extra_config) -> Dict[str, _Plan]:
    plans: Dict[str, _Plan] = {}
    block_based = fmt in _GPTQ_FAMILY
    extra = dict(extra_config or {})
    for name, m in linears:
        n, k = m.out_features, m.in_features
        p = _Plan(name, n, k, None)
        plans[name] = p
        p.in_block = not blocks or any(name.startswith(b + ".") for b in blocks)
        if name == lm_name:
            if not opts["quantize_lm_head"]:
                continue
        elif any(_match(pat, name) for pat in ignore):
            p.reason = "ignored"
            continue
        elif block_based and not p.in_block:
            p.reason = f"outside the quantized blocks {list(blocks)}"
            continue
        gs, sym = opts["group_size"], opts["sym"]
        over = next((v for key, v in extra.items() if _match(key, name)), None)
        if over is not None:
            bits = over.get("bits", 4)
            if bits is None or bits >= 16 or over.get("data_type") in ("float", "fp"):
                p.reason = "extra_config: kept at 16 bits"
                continue
            if bits != 4:
                raise WriterError(f"{fmt}: extra_config[{name!r}] bits={bits} is not supported; supported: 4 or 16")
            gs = _norm_group(over.get("group_size", gs))
            sym = bool(over.get("sym", sym))
            if fmt == "autoround-awq" and gs == -1:
                raise WriterError(f"{fmt}: extra_config[{name!r}] group_size=-1 is not supported by the AWQ layout")
        spec, kind, zmin = _spec_for(fmt, opts, gs, sym, opts["v1"])
        problem = _layout_problem(fmt, spec.layout, n, k, gs, sym)
        if problem:
            msg = (f"{fmt}: {name} (Linear out_features N={n}, in_features K={k}, weight [{n}, {k}]): {problem}; "
                   f"supported: {_supported_groups(fmt, k) if 'group_size' in problem else 'N, K multiples of 8/16'}"
                   ", or pass skip_incompatible=True (hf-w4 convert --skip-incompatible) to leave such modules "
                   "dense")
            if not skip_incompatible:
                raise WriterError(msg)
            p.reason = f"incompatible shape: {problem}"
            continue
        p.spec, p.kind, p.group_size, p.sym, p.zero_min = spec, kind, gs, sym, zmin
    return plans


def _scale_dtype(fmt: str, dtype: torch.dtype) -> torch.dtype:
    if fmt in _GPTQ_FAMILY:
        return torch.float16
    if fmt in _NVFP4:
        return layouts.FP8
    return dtype


def _input_amax(model: nn.Module, plans: Dict[str, _Plan], given, seed: int) -> Dict[str, float]:
    names = [p.name for p in plans.values() if p.spec is not None]
    if given is not None:
        if isinstance(given, dict):
            missing = [n for n in names if n not in given]
            if missing:
                raise WriterError(f"modelopt-nvfp4: input_amax has no value for {missing[:3]} ...")
            return {n: float(given[n]) for n in names}
        return {n: float(given) for n in names}
    # calibration-free stand-in: max |x| seen by each Linear on one forward of seeded random tokens
    amax = {n: 0.0 for n in names}
    mods = dict(model.named_modules())
    hooks = []
    for n in names:
        def hook(_m, inp, _out, n=n):
            amax[n] = max(amax[n], float(inp[0].detach().abs().max()))
        hooks.append(mods[n].register_forward_hook(hook))
    try:
        vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
        dev = next(model.parameters()).device
        ids = torch.randint(0, max(vocab, 2), (1, 32), generator=torch.Generator().manual_seed(seed)).to(dev)
        was = model.training
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
        model.train(was)
    except Exception:  # noqa: BLE001 - an exotic forward: fall back to a constant
        amax = {n: 0.0 for n in names}
    finally:
        for h in hooks:
            h.remove()
    return {n: (v if v > 0 else 1.0) for n, v in amax.items()}


# ----------------------------------------------------------------------------------------------
# quantization_config dicts (key order as the producers write them)


def _dense_names(plans, lm_name, *, in_block_only=False) -> List[str]:
    return [p.name for p in plans.values() if p.spec is None and p.name != lm_name
            and (p.in_block or not in_block_only)]


def _quant_config(fmt, opts, plans, lm_name, emb_name, blocks, extra_config, dtype) -> dict:
    gs_arg = opts["group_size"]
    sym = opts["sym"]
    lm_q = plans.get(lm_name) is not None and plans[lm_name].spec is not None
    block_str = ",".join(blocks) if blocks else None
    if fmt == "gptq":
        q = {"bits": 4, "group_size": gs_arg, "sym": sym, "data_type": "int", "autoround_version": AUTOROUND_VERSION,
             "provider": "auto-round", "lm_head": lm_q, "quant_method": "gptq", "desc_act": opts["desc_act"],
             "true_sequential": False, "damp_percent": 0.01}
        if opts["checkpoint_format"] is not None:
            q["checkpoint_format"] = opts["checkpoint_format"]
        dense = _dense_names(plans, lm_name)
        if dense:  # auto-round's gptq export: GPTQModel-style negative "dynamic" entries
            q["dynamic"] = {"-:" + re.escape(n) + "$": {} for n in dense}
        return q
    if fmt.startswith("autoround"):
        q = {"bits": 4, "group_size": gs_arg, "sym": sym, "data_type": "int", "autoround_version": AUTOROUND_VERSION,
             "block_name_to_quantize": block_str, "quant_method": "auto-round",
             "packing_format": "auto_round:auto_gptq" if fmt == "autoround" else "auto_round:auto_awq"}
        if block_str is None:
            q.pop("block_name_to_quantize")
        extra = {k: dict(v) for k, v in (extra_config or {}).items()}
        for n in _dense_names(plans, lm_name, in_block_only=True):
            if not any(_match(k, n) for k in extra):
                extra[n] = {"bits": 16, "data_type": "float"}
        if lm_q:
            extra[lm_name] = {"bits": 4, "group_size": plans[lm_name].group_size, "sym": plans[lm_name].sym,
                              "data_type": "int"}
        if extra:
            q["extra_config"] = extra
        return q
    if fmt == "awq":
        return {"bits": 4, "group_size": gs_arg, "sym": sym, "data_type": "int", "autoround_version": AUTOROUND_VERSION,
                "provider": "auto-round", "quant_method": "awq", "version": "gemm", "zero_point": not sym,
                "modules_to_not_convert": [lm_name] + _dense_names(plans, lm_name, in_block_only=True),
                **({"to_quant_block_names": block_str} if block_str else {})}
    ignore = ([] if lm_q else [lm_name]) + _dense_names(plans, lm_name)
    if fmt in _MODELOPT:
        w = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
        group = {"targets": ["Linear"], "weights": dict(w)}
        if fmt == "modelopt-nvfp4":
            group["input_activations"] = dict(w)
        return {"quant_method": "modelopt", "quant_algo": "NVFP4" if fmt == "modelopt-nvfp4" else "W4A16_NVFP4",
                "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
                "ignore": ([] if lm_q else [lm_name]) + [emb_name] + _dense_names(plans, lm_name),
                "config_groups": {"group_0": group}}
    act8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token",
            "block_structure": None, "dynamic": True, "actorder": None, "scale_dtype": None, "zp_dtype": None,
            "observer": None, "observer_kwargs": {}}

    def weights(bits, typ, strategy, group, symmetric, scale_dtype=None, observer="minmax"):
        return {"num_bits": bits, "type": typ, "symmetric": symmetric, "group_size": group, "strategy": strategy,
                "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": scale_dtype,
                "zp_dtype": None if symmetric else "torch.int8", "observer": observer, "observer_kwargs": {}}

    gsp = gs_arg if gs_arg != -1 else None
    strat = "group" if gs_arg != -1 else "channel"
    if fmt == "ct-w4a16":
        form, w, a = "pack-quantized", weights(4, "int", strat, gsp, sym), None
    elif fmt == "ct-w8a8":
        form, w, a = "int-quantized", weights(8, "int", "channel", None, True), act8
    elif fmt == "ct-w4a8":
        form, w, a = "int-quantized", weights(4, "int", strat, gsp, True), act8
    else:
        form = "nvfp4-pack-quantized"
        w, a = weights(4, "float", "tensor_group", 16, True, "torch.float8_e4m3fn", "static_minmax"), None
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a,
                                          "output_activations": None, "format": form}},
            "format": form, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": CT_VERSION}


def _recipe(fmt: str, q: dict) -> str:
    scheme = {"ct-w4a16": "W4A16", "ct-w8a8": "W8A8", "ct-w4a8": "W4A8", "ct-nvfp4": "NVFP4A16"}[fmt]
    ign = ", ".join(json.dumps(x) for x in q["ignore"])
    return ("default_stage:\n  default_modifiers:\n    QuantizationModifier:\n      targets: [Linear]\n"
            f"      ignore: [{ign}]\n      scheme: {scheme}\n")


# ----------------------------------------------------------------------------------------------
# files


def _dump(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _load_dense(src: Path) -> nn.Module:
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


def _side_files(src: Path) -> List[Path]:
    """Tokenizer, generation config, chat template, ... (every top-level file that is not weights/config)."""
    return [f for f in sorted(src.iterdir()) if f.is_file() and not f.name.startswith(".")
            and f.name not in _SKIP_FILES and not f.name.endswith(_WEIGHT_SUFFIXES)]


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in _side_files(src):
        if not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


def _output_path(out_dir) -> Path:
    """A symlink is followed: the checkpoint is written (atomically) where it points and the link stays; renaming
    onto the link itself would replace the link, not the directory the user meant."""
    out = Path(out_dir).absolute()
    return Path(os.path.realpath(out)) if out.is_symlink() else out


def _check_source(src: Optional[Path], out: Path) -> None:
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


def _check_target(out: Path, side: Sequence[str] = ()) -> None:
    """An existing ``out`` is replaced only if every entry in it is a file matching :data:`_CHECKPOINT_FILES` or
    named like one of the source's side files the new checkpoint gets (``side``); otherwise it is refused,
    naming the other entries, so a user's notes, runs or a model cache are never deleted."""
    if out.exists() and not out.is_dir():
        raise WriterError(f"{out}: exists and is not a directory")
    if not out.is_dir():
        return
    other = sorted(e.name + ("/" if e.is_dir() else "") for e in out.iterdir()
                   if not (e.is_file() and (e.name in side
                                            or any(fnmatch.fnmatchcase(e.name, p) for p in _CHECKPOINT_FILES))))
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
