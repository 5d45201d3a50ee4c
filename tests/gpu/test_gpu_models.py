"""cuda_w4a16 end to end on a GPU: checkpoints in every 4-bit format, written by hf_w4's writers, load with
device_map="cuda" onto the CUDA kernel and give the logits of the CPU path (the reference kernel, fp32: cosine >=
0.9999), save back bit-exact, generate, and run under torch.compile and a CUDA graph."""
from __future__ import annotations


import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): GPU tests need one", allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402

import hf_w4  # noqa: E402
from conftest import assert_same_checkpoint, capture_cuda_graph, cosine  # noqa: E402
from hf_w4.nn import QuantLinear  # noqa: E402

FORMATS = [("gptq", dict(sym=True)), ("gptq", dict(sym=False, group_size=64, desc_act=True)),
           ("gptq", dict(sym=False, checkpoint_format="gptq_v2", group_size=32)), ("autoround", dict(sym=True)),
           ("autoround-awq", dict(sym=False)), ("awq", dict(sym=False)), ("ct-w4a16", dict(sym=True)),
           ("ct-w4a16", dict(sym=False, group_size=32)), ("ct-w4a16", dict(sym=True, group_size=-1)),
           ("ct-nvfp4", dict()), ("modelopt-w4a16", dict()), ("modelopt-nvfp4", dict())]
IDS = [f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in FORMATS]

pytestmark = pytest.mark.usefixtures("hf_w4_installed")


def _ids(device):
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_from_pretrained_cuda_matches_cpu_path(written, fmt, opts, dtype, tmp_path):
    res = written(fmt, opts)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=dtype, device_map="cuda")
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qls and all(m.kernel.NAME == "cuda_w4a16" for m in qls), \
        {m.name: (str(m.kernel), m.kernel_reasons) for m in qls if m.kernel.NAME != "cuda_w4a16"}
    cpu = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    with torch.no_grad():
        y = model(_ids("cuda")).logits
        ref = cpu(_ids("cpu")).logits
    cos = cosine(y.cpu(), ref)
    assert cos >= 0.9999, f"{fmt} {opts} {dtype}: cosine {cos:.6f} to the CPU path's logits"
    if dtype == torch.bfloat16:  # as on disk: every tensor comes back bit-exact after the GPU repack
        model.save_pretrained(tmp_path / "re")
        assert_same_checkpoint(res.path, tmp_path / "re")


@pytest.fixture(scope="module")
def gptq_cuda(written):
    res = written("gptq", dict(sym=True))
    hf_w4.install()  # a module fixture is made before the function-scoped hf_w4_installed; the model stays hf_w4's
    return AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16, device_map="cuda")


def test_generate(gptq_cuda):
    out = gptq_cuda.generate(_ids("cuda"), max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 20)


def test_cuda_graph_of_the_model(gptq_cuda):
    """A whole forward (no cache) captured in a CUDA graph and replayed on new tokens."""
    ids, other = _ids("cuda"), torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        want = gptq_cuda(other, use_cache=False).logits
        static = ids.clone()
        graph, out = capture_cuda_graph(lambda: gptq_cuda(static, use_cache=False).logits)
        static.copy_(other)
        graph.replay()
        torch.cuda.synchronize()
        assert cosine(out, want) >= 0.9999


def test_compile_model(gptq_cuda):
    ids = _ids("cuda")
    with torch.no_grad():
        eager = gptq_cuda(ids, use_cache=False).logits
        compiled = torch.compile(gptq_cuda)
        assert cosine(compiled(ids, use_cache=False).logits, eager) >= 0.9999


def test_reference_kernel_runs_on_cuda(written, monkeypatch):
    """The pure-PyTorch reference (HF_W4_KERNEL=torch_reference) on CUDA tensors agrees with the CUDA kernel."""
    res = written("ct-w4a16", dict(sym=False, group_size=32))
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16, device_map="cuda")
    monkeypatch.setenv("HF_W4_KERNEL", "torch_reference")
    ref = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16, device_map="cuda")
    assert all(m.kernel.NAME == "torch_reference" for m in ref.modules() if isinstance(m, QuantLinear))
    with torch.no_grad():
        assert cosine(model(_ids("cuda")).logits, ref(_ids("cuda")).logits) >= 0.9999


def test_cli_eval_on_cuda(tiny, tmp_path, capsys):
    """``hf-w4 eval --device cuda`` of a GPTQ checkpoint (``hf-w4 convert`` of the tiny model): the quantized layers
    run on cuda_w4a16, the perplexity is the CPU run's within 1 %, decoding is timed on the GPU."""
    import json
    from hf_w4.tools import cli
    ckpt = tmp_path / "gptq"
    assert cli.main(["convert", str(tiny), str(ckpt), "--format", "gptq", "--no-progress"]) == 0
    assert cli.main(["info", str(ckpt), "--device", "cuda"]) == 0
    assert "cuda_w4a16" in capsys.readouterr().out
    fast = ["--max-tokens", "256", "--window", "64", "--decode-tokens", "4", "--dtype", "fp16", "--no-progress"]
    runs = {}
    for dev in ("cpu", "cuda"):
        out = tmp_path / f"{dev}.json"
        assert cli.main(["eval", str(ckpt), "--device", dev, "--json", str(out), *fast]) == 0
        runs[dev] = json.loads(out.read_text())
    text = capsys.readouterr().out
    cu = runs["cuda"]
    assert cu["device"] == "cuda:0" and "cuda_w4a16" in cu["kernels"], cu["kernels"]
    assert cu["peak_cuda_bytes"] > 0 and cu["decode_tok_per_s"] > 0 and "peak CUDA" in text
    assert abs(cu["perplexity"] / runs["cpu"]["perplexity"] - 1) < 0.01, (cu["perplexity"], runs["cpu"]["perplexity"])


def test_cli_demo_on_cuda(tiny, tmp_path, capsys):
    """``hf-w4 demo --device cuda`` (the README's main job on a GPU): the dense baseline and each format run on the
    GPU, the 4-bit formats on cuda_w4a16."""
    import json
    from hf_w4.tools import cli
    out = tmp_path / "rows.json"
    rc = cli.main(["demo", "--model", str(tiny), "--formats", "gptq,ct-nvfp4", "--w4a8", "none", "--quick",
                   "--dtype", "fp16", "--device", "cuda", "--json", str(out), "--no-progress"])
    rows = json.loads(out.read_text())
    assert rc == 0, rows
    assert rows[0]["device"] == "cuda:0" and "Every model ran on cuda:0" in capsys.readouterr().out
    for r in rows[1:]:
        assert r["status"] == "ok" and "cuda_w4a16" in r["kernels"], r

