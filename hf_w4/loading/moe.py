"""MoE experts one Linear per expert projection, as the producers quantize and store them.

transformers 5 fuses a MoE layer's experts into one module with 3-D parameters (``Qwen3MoeExperts``:
``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) and merges a checkpoint's per-expert weights into them
while loading (the model's conversion mapping). GPTQ / AWQ / auto-round / compressed-tensors / ModelOpt write
one quantized Linear per expert projection (``mlp.experts.3.gate_proj.qweight``), which that merge cannot take.
So where the checkpoint stores an experts module per expert, hf_w4 swaps it for :class:`UnfusedExperts`: a
``ModuleList`` of experts, each holding its projections as ``nn.Linear`` under the checkpoint's names (taken
from the model's own merge: ``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``),
which the quantizer then swaps for ``QuantLinear`` like any other Linear; the model's merges into such modules
are dropped, so the tensors load under their stored names and ``save_pretrained`` writes them back the same way.
The forward is the one of transformers' eager experts (route, per hit expert ``act(gate) * up`` then ``down``,
weighted, summed), with each projection through the compiled kernel; where all of them run on cpu_w4a16, a step
of few tokens runs as one compiled call over the experts' buffers stacked per layer (``moe_stack.py``), with the
same result.

Unfused are experts modules with the default gate (``act_fn(gate) * up``, concatenated gate then up) and no
post-expert norm; others (a custom ``_apply_gate`` such as gpt-oss's, interleaved gate/up) stay fused, and a
checkpoint that stores quantized tensors for them per expert is refused with the reason.
"""
from __future__ import annotations

import contextlib
import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..nn import layout_changed, layout_epoch
from . import moe_stack
from .checkpoint import QUANTIZED_WEIGHT_TENSORS, CheckpointError

FUSED = ("gate_up_proj", "down_proj")   # the fused experts' parameters this module reads
DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")


def is_fused_experts(m: nn.Module) -> bool:
    """A transformers experts module with 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    ps = [getattr(m, p, None) for p in FUSED]
    return all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in ps)


def fused_problem(m: nn.Module) -> Optional[str]:
    """Why hf_w4 cannot run this fused experts module per expert (None: it can)."""
    if not hasattr(m, "is_concatenated"):
        # not built through transformers' use_experts_implementation (e.g. Llama 4's experts): another forward
        # signature and weight layout
        return "it is not a standard transformers experts module (no use_experts_implementation)"
    try:
        dims(m)
    except ValueError as e:
        return str(e)
    if getattr(m, "has_gate", True) is False:
        return "it has no gate projection"
    if getattr(m, "is_concatenated", True) is False:
        return "its gate and up projections are interleaved"
    if getattr(m, "has_post_expert_norm", False):
        return "it normalizes each expert's output"
    gate = getattr(type(m), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        return f"it has its own gate function ({type(m).__name__}._apply_gate)"
    if not callable(getattr(m, "act_fn", None)):
        return "it has no act_fn"
    if getattr(m, "has_bias", False) and not all(
            isinstance(getattr(m, f"{p}_bias", None), torch.Tensor) for p in FUSED):
        return "it has biases hf_w4 cannot find (gate_up_proj_bias / down_proj_bias)"
    return None


def dims(m: nn.Module) -> Tuple[int, int, int]:
    """(experts, hidden, intermediate) of a fused experts module."""
    gu, dn = m.gate_up_proj, m.down_proj
    if getattr(m, "is_transposed", False):
        e, h, i2 = gu.shape
        want = (e, i2 // 2, h)
    else:
        e, i2, h = gu.shape
        want = (e, h, i2 // 2)
    if i2 % 2 or tuple(dn.shape) != want:
        raise ValueError(f"{type(m).__name__}: gate_up_proj {list(gu.shape)} and down_proj {list(dn.shape)} "
                         "are not the shapes of fused gate/up and down projections")
    return e, h, i2 // 2


class _Watched(nn.Module):
    """A module whose submodules a one-call experts forward reads directly: swapping one (PEFT's LoRA wrappers,
    dequantize, set_submodule) marks the layouts changed, so the layer checks its experts again."""

    def __setattr__(self, name, value):
        if isinstance(value, nn.Module) or name in self.__dict__.get("_modules", ()) or name == "act_fn":
            layout_changed()
        super().__setattr__(name, value)

    def __delattr__(self, name):
        layout_changed()
        super().__delattr__(name)

    def add_module(self, name, module):
        layout_changed()
        super().add_module(name, module)


class Expert(_Watched):
    """One expert's projections, as attributes named like the checkpoint's."""

    def __init__(self, names: Sequence[str], linears: Sequence[nn.Module]):
        super().__init__()
        for n, lin in zip(names, linears):
            setattr(self, n, lin)


class UnfusedExperts(_Watched):
    """The experts of one MoE layer, one module per expert (children ``0`` .. ``E-1``, as the checkpoint names
    them); called as the fused module it replaces:
    ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

    Where every expert projection runs on cpu_w4a16 (and the rest of :func:`hf_w4.loading.moe_stack.stack`'s
    conditions hold), a step of up to ``MAX_TOKENS`` tokens runs all routed experts in one compiled call, over the
    experts' kernel buffers stacked per layer (:meth:`one_call`); otherwise, and for gradients, each projection is
    called in turn."""

    def __init__(self, experts: Sequence[Expert], names: Sequence[str], act_fn, fused_type: str = "",
                 path: str = "experts"):
        super().__init__()
        for i, e in enumerate(experts):
            self.add_module(str(i), e)
        self.names = tuple(names)
        self.act_fn = act_fn
        self.num_experts = len(experts)
        self.fused_type = fused_type
        self.path = path   # for messages
        self._stacked = None   # a moe_stack.StackedExperts, or None
        self._stack_epoch = -1   # the layout_epoch() it was checked at
        self.one_call_problem = "not checked yet"   # why the experts do not run as one call ("" when they do)

    def __getitem__(self, i: int) -> Expert:
        return self._modules[str(i)]

    def __len__(self) -> int:
        return self.num_experts

    def extra_repr(self) -> str:
        return f"unfused {self.fused_type}, projections {'/'.join(self.names)}"

    def one_call(self):
        """The experts as one compiled call (a ``StackedExperts``), or None where they cannot run so
        (``one_call_problem`` says why). Checked again whenever ``hf_w4.nn.layout_epoch()`` moved."""
        epoch = layout_epoch()
        if self._stack_epoch != epoch:
            experts = [self[i] for i in range(self.num_experts)]
            self._stacked, self.one_call_problem = moe_stack.stack(self.path, self.names, experts, self.act_fn)
            self._stack_epoch = epoch
        return self._stacked

    def one_call_summary(self) -> str:
        """How the experts run, for ``kernel_report``."""
        if self.one_call() is not None:
            return (f"MoE experts: the routed experts of up to {moe_stack.MAX_TOKENS} tokens in one cpu_w4a16_moe call "
                    "(more tokens, and gradients: one projection at a time)")
        return f"MoE experts: one projection at a time ({self.one_call_problem})"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        one = self.one_call()
        if one is not None and one.takes(hidden_states, top_k_weights):
            return one(hidden_states, top_k_index, top_k_weights)
        return self.per_expert(hidden_states, top_k_index, top_k_weights)

    def per_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """The forward one projection call at a time (each through its module: hooks, adapters, gradients)."""
        # the (token, slot) pairs sorted by expert, gathered once; each expert's rows are then a slice, and the
        # weighted outputs go back in one index_add (indices >= num_experts, masked experts, are skipped)
        gate_name, up_name, down_name = self.names
        if hidden_states.shape[0] == 1:   # one token (decode): its experts in turn, no sorting or scatter
            # weighted in the dtypes of the general path and summed as its index_add_ does on the CPU: in fp32, in
            # ascending expert order, rounded once
            acc = torch.zeros(hidden_states.shape, dtype=torch.promote_types(hidden_states.dtype, torch.float32),
                              device=hidden_states.device)
            weights = top_k_weights[0]
            for e, j in sorted((e, j) for j, e in enumerate(top_k_index[0].tolist())):
                if e >= self.num_experts:
                    continue
                expert = self[e]
                h = self.act_fn(getattr(expert, gate_name)(hidden_states)) * getattr(expert, up_name)(hidden_states)
                acc += (getattr(expert, down_name)(h) * weights[j:j + 1]).to(hidden_states.dtype)
            return acc.to(hidden_states.dtype)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)[:self.num_experts].tolist()
        order = order[:sum(counts)]
        token = order // k
        x = hidden_states[token]
        ys, start = [], 0
        for e, c in enumerate(counts):
            if not c:
                continue
            expert, xe = self[e], x[start:start + c]
            h = self.act_fn(getattr(expert, gate_name)(xe)) * getattr(expert, up_name)(xe)
            ys.append(getattr(expert, down_name)(h))
            start += c
        out = torch.zeros_like(hidden_states)
        if ys:
            y = (ys[0] if len(ys) == 1 else torch.cat(ys)) * top_k_weights.reshape(-1)[order, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _patterns(c) -> Tuple[List[str], List[str]]:
    """A transformers WeightConverter's (source, target) patterns as written in the conversion mapping."""
    sources = getattr(c, "_original_source_patterns", None) or c.source_patterns
    targets = getattr(c, "_original_target_patterns", None) or c.target_patterns
    return [str(x) for x in sources], [str(x) for x in targets]


def projection_names(model: nn.Module) -> Optional[Tuple[str, str, str]]:
    """(gate, up, down) per-expert projection names the model's conversion mapping merges into its fused experts;
    None where it has no such merge (its checkpoints store the experts fused, e.g. GraniteMoE, Qwen3-VL-MoE)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
        transforms = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 - another transformers: no merge known
        return None
    found: Dict[str, List[str]] = {}
    for t in transforms:
        if not isinstance(t, WeightConverter):
            continue
        sources, targets = _patterns(t)
        for param in FUSED:
            if any(x.rstrip("$").endswith(f"experts.{param}") for x in targets):
                names = [re.search(r"experts\.\*\.(\w+)\.weight", x) for x in sources]
                if all(names):
                    found[param] = [n.group(1) for n in names]
    gate_up, down = found.get("gate_up_proj", []), found.get("down_proj", [])
    if len(gate_up) == 2 and len(down) == 1:
        return gate_up[0], gate_up[1], down[0]
    return None


def _linear(n_in: int, n_out: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
            like: torch.Tensor, has_bias: bool) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=has_bias, device="meta" if weight is None else like.device, dtype=like.dtype)
    if weight is not None:   # views of the fused parameters: no copy
        lin.weight = nn.Parameter(weight, requires_grad=like.requires_grad)
        if has_bias:
            lin.bias = nn.Parameter(bias, requires_grad=like.requires_grad)
    elif like.device.type != "meta":
        lin = lin.to_empty(device=like.device)
    return lin


def unfuse(m: nn.Module, names: Sequence[str], share: bool = False, path: str = "experts") -> UnfusedExperts:
    """An :class:`UnfusedExperts` for the fused module ``m``: with ``share``, its Linears are views of ``m``'s
    parameters (same values, no copy); otherwise new, uninitialised ones on ``m``'s device, for loading."""
    problem = fused_problem(m)
    if problem:
        raise ValueError(f"{type(m).__name__} cannot run one expert at a time: {problem}")
    e, h, i = dims(m)
    gu, dn = m.gate_up_proj, m.down_proj
    has_bias = bool(getattr(m, "has_bias", False))
    t = getattr(m, "is_transposed", False)
    experts = []
    for x in range(e):
        if share:
            w_gu = gu[x].t() if t else gu[x]          # [2I, H]
            w_dn = dn[x].t() if t else dn[x]          # [H, I]
            b_gu = m.gate_up_proj_bias[x] if has_bias else None
            b_dn = m.down_proj_bias[x] if has_bias else None
            lins = [_linear(h, i, w_gu[:i], b_gu[:i] if has_bias else None, gu, has_bias),
                    _linear(h, i, w_gu[i:], b_gu[i:] if has_bias else None, gu, has_bias),
                    _linear(i, h, w_dn, b_dn, dn, has_bias)]
        else:
            lins = [_linear(h, i, None, None, gu, has_bias), _linear(h, i, None, None, gu, has_bias),
                    _linear(i, h, None, None, dn, has_bias)]
        experts.append(Expert(names, lins))
    return UnfusedExperts(experts, names, m.act_fn, type(m).__name__, path)


def fused_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if is_fused_experts(m))


def _per_expert_layout(model: nn.Module) -> List[Tuple[str, nn.Module, Tuple[str, str, str]]]:
    """(path, module, projection names) of each fused experts module that the model's own checkpoints store per
    expert (a per-expert merge in its conversion mapping) and hf_w4 can run per expert."""
    names = projection_names(model)
    return [(p, m, names) for p, m in fused_modules(model) if names and fused_problem(m) is None]


@contextlib.contextmanager
def unfused(model: nn.Module):
    """Within the block, every fused experts module of ``model`` whose checkpoints are per expert is an
    :class:`UnfusedExperts` over views of its parameters (what a producer sees: one Linear per expert projection);
    restored on exit."""
    swapped = []
    try:
        for path, m, names in _per_expert_layout(model):
            model.set_submodule(path, unfuse(m, names, share=True, path=path))
            swapped.append((path, m))
        yield [p for p, _ in swapped]
    finally:
        for path, m in swapped:
            model.set_submodule(path, m)


def unfuse_all(model: nn.Module) -> List[str]:
    """Replace every fused experts module whose checkpoints are per expert by a new (uninitialised)
    :class:`UnfusedExperts`; their paths."""
    layout = _per_expert_layout(model)
    for path, m, names in layout:
        model.set_submodule(path, unfuse(m, names, path=path))
    return [p for p, _, _ in layout]


def has_unfused(model: nn.Module) -> bool:
    return any(isinstance(m, UnfusedExperts) for m in model.modules())


def drop_expert_merges(conversions: list, model: nn.Module, fusable: bool = True) -> list:
    """The model's conversions without those that merge per-expert tensors into an experts module hf_w4 runs
    per expert (an :class:`UnfusedExperts`, or with ``fusable`` a fused one it can unfuse): those tensors load as
    stored."""
    try:
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return conversions
    targets = [t for n, m in model.named_modules()
               if isinstance(m, UnfusedExperts) or (fusable and is_fused_experts(m) and fused_problem(m) is None)
               for t in (f"{n}.{p}" for p in FUSED)]
    if not targets:
        return conversions

    def merges_into_experts(c) -> bool:   # per-expert sources (experts.*.x) into one of those modules' params
        if not isinstance(c, WeightConverter):
            return False
        sources, pats = _patterns(c)
        if not any(re.search(r"experts\.\*\.", x) for x in sources):
            return False   # e.g. Qwen3-VL-MoE's transpose of fused tensors
        pats = [x.lstrip("^").rstrip("$") for x in pats]
        return any(re.search(r"experts\.(gate_up_proj|down_proj)$", p) and any(t.endswith(p.lstrip("."))
                   for t in targets) for p in pats)

    return [c for c in conversions if not merges_into_experts(c)]


def _stored_per_expert(headers: dict, path: str) -> Dict[str, List[str]]:
    """``expert.projection`` -> tensor names of the tensors ``headers`` hold under the experts module at ``path``
    one per expert (``path.3.gate_proj.qweight``)."""
    p = path + "."
    stored: Dict[str, List[str]] = {}
    for key in headers:
        if key.startswith(p):
            parts = key[len(p):].split(".")
            if len(parts) == 3 and parts[0].isdigit():
                stored.setdefault(f"{parts[0]}.{parts[1]}", []).append(parts[2])
    return stored


def unfuse_for_checkpoint(model: nn.Module, headers: dict) -> List[str]:
    """Unfuse every fused experts module whose tensors ``headers`` (keyed by loading names) store per expert;
    their paths. Raises ``CheckpointError`` where that cannot work and the tensors are quantized, and where the
    stored projection names or expert numbers do not fit the module."""
    names = None
    done = []
    for path, m in list(fused_modules(model)):
        stored = _stored_per_expert(headers, path)
        if not stored:
            continue
        quantized = sorted(k for k, ts in stored.items() if set(ts) & QUANTIZED_WEIGHT_TENSORS)
        problem = fused_problem(m)
        if problem:
            if quantized:
                raise CheckpointError(
                    f"{path} ({type(m).__name__}): the checkpoint stores its experts quantized one Linear per "
                    f"expert (e.g. {path}.{quantized[0]}), but hf_w4 cannot run this experts module one expert at "
                    f"a time: {problem}. Supported: experts with act_fn(gate) * up (Qwen2/3-MoE, Mixtral, OLMoE, "
                    "DeepSeek-V2/V3 and the like)")
            continue
        # the model's per-expert merge names them; without one (its own checkpoints store the experts fused), the
        # producers' usual names
        names = names or projection_names(model) or DEFAULT_NAMES
        e = dims(m)[0]
        bad_names = sorted({k.split(".")[1] for k in stored} - set(names))
        bad_experts = sorted({int(k.split(".")[0]) for k in stored if int(k.split(".")[0]) >= e})
        if bad_names or bad_experts:
            found = f"projection(s) {bad_names}" if bad_names else f"expert number(s) {bad_experts[:5]}"
            raise CheckpointError(
                f"{path} ({type(m).__name__}, {e} experts): the checkpoint stores {found} under it; this model's "
                f"experts are {path}.0..{e - 1} with projections {list(names)}")
        model.set_submodule(path, unfuse(m, names, path=path))
        done.append(path)
    return done


def without_unfused_merges(get_mapping):
    """``get_model_conversion_mapping`` that leaves out the merges into a model's :class:`UnfusedExperts` (for
    PEFT / transformers' adapter loading, which call it without the model's quantizer)."""
    def get_model_conversion_mapping(model, *args, **kwargs):
        out = get_mapping(model, *args, **kwargs)
        return drop_expert_merges(out, model, fusable=False) if has_unfused(model) else out
    get_model_conversion_mapping._hf_w4_wraps = get_mapping
    return get_model_conversion_mapping


def sequential_for_checkpoint(model: nn.Module, headers: dict) -> List[str]:
    """Experts modules transformers itself swaps for a per-expert version when a quantized checkpoint stores them
    per expert (``MODULES_TO_PATCH_FOR_QUANTIZATION``: Llama 4's experts -> ``SequentialLlama4TextExperts``), swapped
    where ``headers`` show per-expert tensors, for every format (transformers does it by quant_method, for
    compressed-tensors and bitsandbytes, whatever the files hold). Their paths."""
    try:
        from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION as patches
    except ImportError:
        return []
    done = []
    for path, m in list(model.named_modules()):
        entry = patches.get(type(m).__name__)
        if entry is None or not _stored_per_expert(headers, path):
            continue
        device = next(m.parameters()).device
        with torch.device(device):
            model.set_submodule(path, entry["module_name"](model.config.get_text_config()))
        done.append(path)
    return done
