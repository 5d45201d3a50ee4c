"""``quant_method: modelopt`` (formats.md §6): the config.json form or the bare ``hf_quant_config.json``."""
from __future__ import annotations

import logging

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
