"""``quant_method: modelopt`` (docs/formats.md, ModelOpt): the config.json form or the bare ``hf_quant_config.json``."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

from .spec import FormatConfig, W4Spec
from ._common import names_of

logger = logging.getLogger("hf_w4")
# quant_algo -> has input_scale tensors (NVFP4 = W4A4 checkpoints, served weight-only)
ALGOS = {"W4A16_NVFP4": False, "NVFP4": True}


def parse(q: dict) -> FormatConfig:
    if "quantization" in q:  # hf_quant_config.json
        q = {**q["quantization"], "producer": q.get("producer")}
    algo = q.get("quant_algo")
    if algo not in ALGOS:
        raise NotImplementedError(f"modelopt quant_algo {algo!r} is not supported; supported: {sorted(ALGOS)}")
    gs = q.get("group_size")
    if gs is None:
        gs = ((q.get("config_groups") or {}).get("group_0", {}).get("weights") or {}).get("group_size", 16)
    if gs != 16:
        raise NotImplementedError(f"modelopt {algo}: group_size={gs} is not supported; supported: [16]")
    if q.get("kv_cache_quant_algo"):
        logger.warning("hf_w4: modelopt kv_cache_quant_algo=%s is ignored (the KV cache stays in the model dtype)",
                       q["kv_cache_quant_algo"])
    if ALGOS[algo]:
        logger.info("hf_w4: modelopt NVFP4 (W4A4) is served weight-only; input_scale is loaded and kept, not applied")
    spec = W4Spec("modelopt", "modelopt_nvfp4", "nvfp4", 4, 16, True, has_input_scale=ALGOS[algo])
    # ModelOpt's exclude_modules are fnmatch wildcards (it writes full names and "module_path*" for a whole
    # subtree); vLLM matches them with fnmatch. A bare name also selects its submodules and dotted suffixes: older
    # exports name parent modules without the "*", which vLLM still catches with a substring fallback
    skip = tuple("glob:" + n for n in names_of("modelopt", "exclude_modules",
                                               q.get("exclude_modules") or q.get("ignore")))
    # ModelOpt quantizes every Linear it does not exclude, lm_head included
    return FormatConfig("modelopt", spec, rules=[(skip, None)] if skip else [], quantize_lm_head=True)


def sidecar_algo(config) -> Optional[str]:
    """The ``quant_algo`` of a local ModelOpt export whose config.json has no quantization_config but which carries
    ``hf_quant_config.json`` (``config``: the loaded config), else None. A file that is not ModelOpt's JSON object is
    an error naming it (the checkpoint next to it is most likely packed: loading it dense would fail obscurely)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    quantized = getattr(config, "quantization_config", None) is not None or \
        getattr(text, "quantization_config", None) is not None
    path = str(getattr(config, "_name_or_path", "") or "")
    side = os.path.join(path, "hf_quant_config.json")
    if quantized or not path or not os.path.isfile(side):
        return None
    try:
        with open(side) as f:
            q = json.load(f)
        algo = (q.get("quantization") or {}).get("quant_algo")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{side}: cannot read ModelOpt's quantization from it ({type(e).__name__}: {e}); config.json "
                         "has no quantization_config, so hf_w4 looked there") from None
    return algo or None  # a KV-cache-only export (quant_algo null) stays a dense model
