"""One rank of test_tensor_parallel.py's ``torchrun --nproc-per-node 2`` run (not a test file).

    torchrun --nproc-per-node 2 tests/loading/tp_worker.py CASES.json OUT_DIR

For each case of CASES.json (``{"name", "path", "config": {class, kwargs}}``) the rank loads the checkpoint with
transformers' tensor parallelism, runs the fixed batch and writes ``OUT_DIR/<name>.<rank>.pt``: the logits, the bytes
its quantized layers hold, their names and those of the ones it split, or the error the load raised.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_w4
from hf_w4.loading import memory

INPUT_IDS = torch.arange(16).reshape(2, 8) * 7 % 500


def main(cases_file: str, out_dir: str) -> None:
    hf_w4.install()
    for case in json.loads(Path(cases_file).read_text()):
        kw = {}
        if case.get("config"):
            kw["quantization_config"] = getattr(hf_w4, case["config"]["class"])(**case["config"]["kwargs"])
        try:
            model = AutoModelForCausalLM.from_pretrained(
                case["path"], distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32, **kw)
        except Exception as e:  # the refusals under test; the other rank raises the same
            res = {"error": f"{type(e).__name__}: {e}"}
        else:
            with torch.no_grad():
                logits = model(INPUT_IDS).logits
            layers = [m for m in model.modules() if isinstance(m, hf_w4.QuantLinear)]
            res = {"logits": logits, "bytes": sum(m.packed_bytes() for m in layers),
                   "split": sorted(m.name for m in layers if m.tp_shard is not None),
                   "layers": sorted(m.name for m in layers),
                   "kernels": sorted({str(m.kernel) for m in layers}),
                   "mapped": memory.mapped(Path(case["path"]).glob("*.safetensors"))}
        torch.save(res, Path(out_dir) / f"{case['name']}.{dist.get_rank()}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
