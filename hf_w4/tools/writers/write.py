"""``write_checkpoint``: quantize a dense causal LM (round-to-nearest) and write it in one of :data:`FORMATS`, laid
out as the producer writes it; :class:`WriteResult` keeps the exact dense weight of every quantized layer."""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import nn

from ... import layouts
from ...loading import moe
from ...nn import plain_linear
from ..rtn import E2M1_MAX, FP8_MAX, RTNResult, quantize_rtn
from . import files
from .formats import FORMATS, ConfigInputs, Format, WriterError
from .plan import check_ignore, check_options, find_blocks, measure_input_amax, plan_modules

MAX_SHARD_SIZE = "50GB"   # transformers' save_pretrained default (tests/tools/test_writers_sharding.py checks it)


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
    _kept: bool = field(repr=False, default=True)

    @property
    def dense_weights(self) -> Dict[str, torch.Tensor]:
        if not self._kept:
            raise WriterError(f"{self.path}: written with keep_dense_twin=False, so the result holds no codes and "
                              "scales to build the dense weights from")
        if self._dense is None:
            self._dense = {name: r.dense() for name, r in self._rtn.items()}
        return self._dense

    def dense_state_dict(self) -> Dict[str, torch.Tensor]:
        """A full fp32 state dict of the dense twin: quantized weights from :attr:`dense_weights`, every other
        tensor exactly as written (rounded to the written dtype) then widened to fp32."""
        dense = self.dense_weights   # first: raises for a result that kept nothing
        sd = {k: v.to(torch.float32) for k, v in self._other.items()}
        for name, w in dense.items():
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


def write_checkpoint(model_or_dir, out_dir, fmt: str, *, group_size: Optional[int] = 128, sym: bool = True,
                     quantize_lm_head: bool = False, ignore: Iterable[str] = (), dtype: torch.dtype = torch.bfloat16,
                     desc_act: bool = False, checkpoint_format: Optional[str] = None,
                     extra_config: Optional[dict] = None, hf_quant_config_only: bool = False, seed: int = 0,
                     skip_incompatible: bool = False, sym_scale: Optional[str] = None,
                     block_name_to_quantize: Optional[Union[str, Sequence[str]]] = None,
                     input_amax: Optional[Union[float, Dict[str, float]]] = None,
                     max_shard_size: Union[int, str] = MAX_SHARD_SIZE, keep_dense_twin: bool = True) -> WriteResult:
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
    ``max_shard_size`` (bytes, or a string such as ``"5GB"`` / ``"500MB"``; default as transformers'
    ``save_pretrained``): the weights go to ``model-0000i-of-0000n.safetensors`` files of at most that size (a larger
    tensor gets a file of its own) with ``model.safetensors.index.json``, or to ``model.safetensors`` when they fit in
    one; huggingface_hub's ``split_torch_state_dict_into_shards`` splits them (and names the files) from the planned
    shapes and dtypes, and each file is quantized and written in turn. ``keep_dense_twin``: the result keeps every
    layer's codes and scales and every other tensor as written (``dense_weights``, ``dense_model``); with False
    (``hf-w4 convert``) the writer holds at most one shard of output and the layer being quantized.
    Everything not quantized is saved in ``dtype``. ``ignore`` patterns that match no Linear, or one that
    matches lm_head together with ``quantize_lm_head``, raise :class:`WriterError`.

    Output: the directory appears atomically (temp dir next to it + rename), with the modes the umask gives
    (0777/0666 minus it). If ``out_dir`` is a symlink, the checkpoint is written where it points. It may not
    be the source directory (or the directory a model object was loaded from), inside it or around it. An
    existing ``out_dir`` is replaced whole, but only if every entry in it is a checkpoint file (a name in
    :data:`files.CHECKPOINT_FILES`, e.g. config.json, *.safetensors, tokenizer files, the quantization side
    configs, README.md) or one of the source's side files the new checkpoint gets; otherwise
    :class:`WriterError` names the other entries and nothing is touched. SIGTERM while the files are written
    (main thread, default SIGTERM action) removes the temp dir before the process dies of the signal.
    """
    if fmt not in FORMATS:
        raise WriterError(f"unknown format {fmt!r}; supported: {list(FORMATS)}")
    f = FORMATS[fmt]
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise WriterError(f"dtype={dtype!r} is not supported; supported: torch.bfloat16, torch.float16, torch.float32")
    max_shard_size = shard_size(max_shard_size)
    opts = check_options(f, group_size, sym, quantize_lm_head, sym_scale, desc_act=desc_act,
                         checkpoint_format=checkpoint_format, extra_config=extra_config,
                         hf_quant_config_only=hf_quant_config_only)
    out = files.output_path(out_dir)
    src_dir, side = None, ()
    if isinstance(model_or_dir, (str, os.PathLike)):
        src_dir = Path(model_or_dir)
        side = [p.name for p in files.side_files(src_dir)] if src_dir.is_dir() else []
        files.check_source(src_dir, out)     # before loading: a wrong output should not cost a model load
        files.check_target(out, side)
        model = files.load_dense(src_dir)
    elif isinstance(model_or_dir, nn.Module):
        model = model_or_dir
        if getattr(model.config, "quantization_config", None) is not None:
            raise WriterError("the source model is already quantized (its config has a quantization_config); "
                              "a dense model is required")
        origin = getattr(model, "name_or_path", "") or ""   # the directory it was loaded from, if any
        files.check_source(Path(origin) if origin else None, out)
        files.check_target(out)
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
        check_ignore(ignore, names, lm_name, opts["quantize_lm_head"])
        emb_name = next((n for n, m in model.named_modules() if in_emb is not None and m is in_emb), "model.embed_tokens")
        tied = (out_emb is not None and in_emb is not None and out_emb.weight.data_ptr() == in_emb.weight.data_ptr())
        if isinstance(block_name_to_quantize, str):
            blocks = tuple(b.strip() for b in block_name_to_quantize.split(",") if b.strip())
        elif block_name_to_quantize:
            blocks = tuple(block_name_to_quantize)
        else:
            b = find_blocks(model, [n for n in names if n != lm_name])
            blocks = (b,) if b else ()
        plans = plan_modules(f, opts, linears, lm_name, blocks, ignore, skip_incompatible)

        # ------------------------------------------------------------- what each quantized layer writes
        gen = torch.Generator().manual_seed(int(seed))
        perms = {}   # act-order permutations, drawn in plan order (the files do not depend on the write order)
        for p in plans.values():
            if p.spec is not None and opts["desc_act"] and p.group_size != -1:
                perms[p.name] = torch.randperm(p.k, generator=gen)
        amax_in = measure_input_amax(model, plans, input_amax, seed) if f.input_scale else {}
        quant = {p.name: p for p in plans.values() if p.spec is not None}
        rtn: Dict[str, RTNResult] = {}

        def layer_tensors(name: str) -> Dict[str, torch.Tensor]:
            """Quantize one layer: its tensors as written (keyed by the model's names)."""
            p, mod = quant[name], mods[name]
            w = mod.weight.detach().to("cpu", torch.float32)
            g_idx = None
            if name in perms:
                g_idx = torch.empty(p.k, dtype=torch.int64)
                g_idx[perms[name]] = torch.arange(p.k) // p.group_size
            r = quantize_rtn(w, p.kind, p.group_size, p.sym, sym_scale=opts["sym_scale"], zero_min=p.zero_min,
                             scale_dtype=f.scale_dtype or dtype, g_idx=g_idx, name=f"{fmt}: {p.name}")
            if p.spec.layout == "gptq" and p.spec.has_g_idx and g_idx is None:
                r.g_idx = torch.arange(p.k) // (p.k if p.group_size == -1 else p.group_size)
            if keep_dense_twin:
                rtn[name] = r
            out = {f"{name}.{t}": v.contiguous() for t, v in r.pack(p.spec).items()}
            if f.input_scale:
                out[f"{name}.input_scale"] = torch.tensor(amax_in[name] / (E2M1_MAX * FP8_MAX), dtype=torch.float32)
            if mod.bias is not None:
                out[f"{name}.bias"] = mod.bias.detach().to("cpu", dtype).contiguous()
            return out

        # ------------------------------------------------------------- the output, as shapes and dtypes
        # every tensor the files get, in the model's order, with the quantized layer it comes from (None: copied
        # from the model in ``dtype``); a tied lm_head is dropped unless it was quantized (untied)
        state = model.state_dict()
        skeleton: Dict[str, torch.Tensor] = {}
        source: Dict[str, Optional[str]] = {}
        seen: Dict[int, str] = {}
        untie = tied and lm_name in quant
        for key, v in state.items():
            owner, _, leaf = key.rpartition(".")
            if owner in quant:
                if leaf == "weight":
                    for t, meta in _declared(quant[owner], f.scale_dtype or dtype, f.input_scale).items():
                        skeleton[f"{owner}.{t}"], source[f"{owner}.{t}"] = meta, owner
                elif leaf == "bias":
                    skeleton[key], source[key] = torch.empty(v.shape, dtype=dtype, device="meta"), owner
                continue
            ptr = v.data_ptr()
            if ptr in seen and v.numel() > 0:
                continue  # shared storage (tied): written once, under its first name
            seen[ptr] = key
            skeleton[key] = torch.empty(v.shape, dtype=dtype if v.is_floating_point() else v.dtype, device="meta")
            source[key] = None

        # ------------------------------------------------------------- configs
        qcfg = f.quant_config(ConfigInputs(opts, plans, lm_name, emb_name, blocks))
        cfg = copy.deepcopy(model.config)
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        if untie:
            cfg.tie_word_embeddings = False
            tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            if tc is not cfg:
                tc.tie_word_embeddings = False
        cfg.dtype = dtype

        # ------------------------------------------------------------- files (atomically), one shard at a time
        other: Dict[str, torch.Tensor] = {}   # the dense twin's other tensors, as written

        def dense_tensor(key: str) -> torch.Tensor:
            t = state[key].detach().to("cpu")
            t = (t.to(dtype) if t.is_floating_point() else t).contiguous()
            if keep_dense_twin:
                other[key] = t.clone()
            return t

        files.check_target(out, side)   # again: the directory may have changed while the model was planned
        disk = _disk_name(model)   # the layout transformers' save_pretrained writes (e.g. Mixtral's block_sparse_moe)
        shards = _Shards(skeleton, source, layer_tensors, dense_tensor, disk, max_shard_size)
        files.write_atomically(out, lambda tmp: _fill(tmp, f, opts, shards, cfg, qcfg, src_dir, model))
        if keep_dense_twin:
            for name in rtn:   # a quantized layer's bias, as written, belongs to the dense twin too
                if mods[name].bias is not None:
                    other[f"{name}.bias"] = mods[name].bias.detach().to("cpu", dtype).contiguous()

    twin_cfg = copy.deepcopy(cfg)
    return WriteResult(path=str(out), fmt=fmt, quantized=list(quant),
                       skipped={p.name: p.reason for p in plans.values() if p.spec is None and p.reason},
                       quantization_config=qcfg, _rtn=rtn, _other=other, _model_cls=type(model), _config=twin_cfg,
                       _kept=keep_dense_twin)


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

def shard_size(value: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int, or a string huggingface_hub reads ("5GB", "500MB", "100KB", digits)."""
    from huggingface_hub.serialization._base import parse_size_to_int
    try:
        n = int(value) if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()) \
            else parse_size_to_int(value)
    except (ValueError, TypeError, AttributeError) as e:
        raise WriterError(f"max_shard_size={value!r}: {str(e).rstrip('.')}; expected a number of bytes or a size "
                          "such as '5GB', '500MB' or '100KB'") from None
    if isinstance(value, bool) or n <= 0:
        raise WriterError(f"max_shard_size={value!r}: expected a positive size such as '5GB', '500MB' or bytes")
    return n


def _declared(p, scale_dtype: torch.dtype, input_scale: bool) -> Dict[str, torch.Tensor]:
    """One quantized layer's tensors as the writer writes them, as meta tensors (shapes and dtypes only): the
    layout's declaration, with the scales in the format's scale dtype."""
    out = {}
    for t, d in layouts.declare(p.spec, p.n, p.k, p.name).items():
        dt = scale_dtype if t in ("scales", "weight_scale") and layouts.FP8 not in d.dtypes else d.dtypes[0]
        out[t] = torch.empty(d.shape, dtype=dt, device="meta")
    if input_scale:
        out["input_scale"] = torch.empty((), dtype=torch.float32, device="meta")
    return out


class _Shards:
    """The weights split into safetensors shards by ``huggingface_hub`` (from shapes and dtypes, before anything
    is quantized), then built one shard at a time: a quantized layer is quantized when its first tensor's shard is
    built, and the tensors it makes for a later shard wait for it (at most one layer's)."""

    def __init__(self, skeleton, source, layer_tensors, dense_tensor, disk, max_shard_size):
        from huggingface_hub import split_torch_state_dict_into_shards
        self.skeleton, self.source, self.disk = skeleton, source, disk
        self.layer_tensors, self.dense_tensor = layer_tensors, dense_tensor
        by_disk = {disk(k): k for k in skeleton}
        self.split = split_torch_state_dict_into_shards({disk(k): v for k, v in skeleton.items()},
                                                        filename_pattern="model{suffix}.safetensors",
                                                        max_shard_size=max_shard_size)
        self.files = {name: [by_disk[d] for d in keys] for name, keys in self.split.filename_to_tensors.items()}

    def __iter__(self):
        """(file name, {disk name: tensor}) per shard, in order."""
        pending: Dict[str, torch.Tensor] = {}
        for name, keys in self.files.items():
            shard = {}
            for key in keys:
                layer = self.source[key]
                if layer is None:
                    v = self.dense_tensor(key)
                else:
                    if key not in pending:
                        pending.update(self.layer_tensors(layer))
                    v = pending.pop(key)
                want = self.skeleton[key]
                if v.shape != want.shape or v.dtype != want.dtype:  # the index was computed from the skeleton
                    raise RuntimeError(f"writer: {key} came out {list(v.shape)} {v.dtype}, planned as "
                                       f"{list(want.shape)} {want.dtype}")
                shard[self.disk(key)] = v
            yield name, shard
        if pending:
            raise RuntimeError(f"writer: tensors made but never written: {sorted(pending)}")

    def index(self) -> Optional[dict]:
        """``model.safetensors.index.json`` for a split checkpoint (None for one file)."""
        if not self.split.is_sharded:
            return None
        return {"metadata": dict(self.split.metadata), "weight_map": dict(self.split.tensor_to_filename)}


def _fill(tmp: Path, f: Format, opts: dict, shards: _Shards, cfg, qcfg: dict, src_dir: Optional[Path], model) -> None:
    """The checkpoint's files in ``tmp``: the weights one shard at a time (and their index when there are several),
    config.json (with or without quantization_config), the format's side files, then the source's tokenizer /
    generation files."""
    from safetensors.torch import save_file
    for name, shard in shards:
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        del shard
    index = shards.index()
    if index is not None:
        files.dump(tmp / "model.safetensors.index.json", index)
    cfg.save_pretrained(str(tmp))
    with open(tmp / "config.json") as fh:
        cj = json.load(fh)
    cj.pop("quantization_config", None)
    if f.in_config_json and not opts["hf_quant_config_only"]:
        cj["quantization_config"] = qcfg
    files.dump(tmp / "config.json", cj)
    for name, text in f.files(qcfg).items():
        (tmp / name).write_text(text)
    if src_dir is not None:
        files.copy_side_files(src_dir, tmp)
    elif getattr(model, "generation_config", None) is not None and not (tmp / "generation_config.json").exists():
        try:
            model.generation_config.save_pretrained(str(tmp))
        except Exception:  # noqa: BLE001 - an odd generation config must not stop the checkpoint
            pass
