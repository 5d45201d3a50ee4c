"""Checkpoint writers: a dense Hugging Face causal LM written as a 4-bit checkpoint, laid out exactly as its producer
writes it (tensor names, dtypes, config keys, side files), with round-to-nearest quantization.

    from hf_w4.tools import writers
    res = writers.write_checkpoint(model_or_dir, "out/ckpt", "gptq", group_size=128, sym=True)
    res.dense_weights["model.layers.0.mlp.up_proj"]   # exact fp32 weight the written codes/scales mean
    twin = res.dense_model()                          # nn.Linear-only fp32 copy with those weights

``formats``: the table of formats, one section per producer; ``plan``: which modules are quantized and how;
``write``: the writer; ``files``: reading the source and publishing the output atomically. The quantization itself
is :mod:`hf_w4.tools.rtn`; each producer's layout and conventions are in docs/formats.md.
"""
from ..rtn import QuantizationError, RTNResult, e2m1_codes, quantize_rtn
from .formats import FORMATS, Format, WriterError
from .write import MAX_SHARD_SIZE, WriteResult, write_checkpoint

__all__ = ["FORMATS", "Format", "WriterError", "QuantizationError", "RTNResult", "WriteResult", "e2m1_codes",
           "quantize_rtn", "write_checkpoint", "MAX_SHARD_SIZE"]
