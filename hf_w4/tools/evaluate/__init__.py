"""Model evaluation: perplexity, top-1 agreement with a dense reference, greedy decode speed, peak RSS; and the demo
that runs every format on one model.

Perplexity method (fixed, so numbers are comparable between formats and runs):

* the text (a file, or the default corpus: every topic of the standard library's ``pydoc_data.topics``
  joined in sorted order, 113 k SmolLM2 tokens, nothing to install) is tokenized once *without* special
  tokens and its first ``max_tokens`` tokens are cut into non-overlapping windows of ``window`` tokens
  (a trailing partial window is dropped);
* if the model needs a BOS token (the tokenizer has one and adds it by default, or the model is a Gemma),
  each window is ``BOS + window-1`` text tokens;
* every window is one forward pass with batch size 1; the loss is the mean NLL of all predicted tokens
  (``window - 1`` per window) and perplexity = ``exp(mean NLL)``.

Data parallel: under ``accelerate launch`` (or any initialized ``torch.distributed`` group) the windows are
dealt round-robin to the ranks, per-window sums are combined with an all-reduce over a zero-filled
per-window vector (adding exact zeros), and the totals are summed in window order on every rank; the result
is the same as the single-process run (bit for bit once ``HF_W4_LARGE_PATH`` fixes cpu_w4a16's large-M path, which
each process otherwise times for itself; see README).

Modules: ``text`` (corpus, windows), ``dist`` (ranks), ``metrics`` (perplexity, decode, memory), ``model`` (loading
and describing the model), ``run`` (``evaluate``), ``demo`` (``run_demo``).
"""
from .demo import (DEMO_GROUP_SIZE, W4A8_FORMATS, demo_formats, demo_w4a8_rows, format_demo_answers,
                   format_demo_table, run_demo)
from .dist import Dist
from .metrics import DecodeResult, PerplexityResult, decode, encode_prompt, model_bytes, peak_rss_bytes, perplexity
from .model import (ACTIVATION_TEXT, TOKENIZER_FILES, activation_used, has_tokenizer, kernels_used, load_model,
                    load_tokenizer, quant_format)
from .run import evaluate, format_eval
from .text import (BOS_MODEL_TYPES, DEFAULT_MAX_TOKENS, DEFAULT_PROMPT, DEFAULT_WINDOW, default_text, make_windows,
                   needs_bos, read_text)

__all__ = ["ACTIVATION_TEXT", "BOS_MODEL_TYPES", "DEFAULT_MAX_TOKENS", "DEFAULT_PROMPT", "DEFAULT_WINDOW",
           "DEMO_GROUP_SIZE", "DecodeResult", "Dist", "PerplexityResult", "TOKENIZER_FILES", "W4A8_FORMATS",
           "activation_used", "decode", "default_text", "demo_formats", "demo_w4a8_rows", "encode_prompt", "evaluate",
           "format_demo_answers", "format_demo_table", "format_eval", "has_tokenizer", "kernels_used", "load_model",
           "load_tokenizer", "make_windows", "model_bytes", "needs_bos", "peak_rss_bytes", "perplexity",
           "quant_format", "read_text", "run_demo"]
