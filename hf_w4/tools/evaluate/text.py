"""The evaluation text and its fixed windows (see the package docstring for the method)."""
from __future__ import annotations

import os
from typing import Optional, Union

import torch


DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULT_WINDOW = 512
DEFAULT_MAX_TOKENS = 4096
BOS_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def default_text() -> str:
    """The default corpus: ``pydoc_data.topics`` (CPython's language reference topics, PSF license)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: Optional[Union[str, os.PathLike]] = None) -> str:
    if path is None:
        return default_text()
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def needs_bos(tokenizer, config=None) -> bool:
    """True when the tokenizer has a BOS token and the model expects it at the start of a sequence: the
    tokenizer adds it by default (Llama-2/3, Gemma tokenizers do; SmolLM2's does not), or the model type
    is known to need it (Gemma)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    if config is not None and getattr(config, "model_type", None) in BOS_MODEL_TYPES:
        return True
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def make_windows(tokenizer, text: str, window: int = DEFAULT_WINDOW, max_tokens: Optional[int] = DEFAULT_MAX_TOKENS,
                 bos: Union[str, bool] = "auto", config=None) -> torch.Tensor:
    """``[n_windows, window]`` int64 token ids as described in the module docstring.

    ``max_tokens`` caps the number of text tokens used (None = all). If fewer tokens than one window are
    available, a single shorter window is returned.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (or None for all), got {max_tokens}")
    use_bos = needs_bos(tokenizer, config) if bos == "auto" else bool(bos)
    if use_bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("BOS requested (--bos yes) but the tokenizer has no bos_token; use --bos auto or no")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    per = window - 1 if use_bos else window
    n = len(ids) // per
    if n == 0:
        per, n = len(ids), 1
        if per < (1 if use_bos else 2):
            raise ValueError(f"text too short for perplexity: {len(ids)} tokens")
    t = torch.tensor(ids[: n * per], dtype=torch.long).view(n, per)
    if use_bos:
        t = torch.cat([torch.full((n, 1), tokenizer.bos_token_id, dtype=torch.long), t], dim=1)
    n_ctx = getattr(config, "max_position_embeddings", None)
    if isinstance(n_ctx, int) and t.shape[1] > n_ctx:
        raise ValueError(f"window of {t.shape[1]} tokens is longer than the model's context of {n_ctx} tokens "
                         f"(config max_position_embeddings); use --window {n_ctx} or less")
    return t
