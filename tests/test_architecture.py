"""The package's shape: no import cycles among hf_w4 modules, and the library never loads its tools."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import hf_w4

ROOT = Path(hf_w4.__file__).parent


def _modules():
    """module name -> source path, for every hf_w4 module."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph():
    """module -> the hf_w4 modules it imports, anywhere in its body (function-level imports count too).
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target not in mods:
                    continue
                for a in node.names:
                    deps.add(f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target)
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_sees_imports():
    g = import_graph()
    assert "hf_w4.nn" in g["hf_w4.integration"] and "hf_w4.peft.lora" in g["hf_w4.integration"]
    assert "hf_w4.ops" in g["hf_w4.tools.bench.w4a16"]              # "from ... import _ext, ops"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_library_never_imports_tools():
    g = import_graph()
    bad = sorted(f"{m} -> {d}" for m, ds in g.items() if not m.startswith("hf_w4.tools")
                 for d in ds if d.startswith("hf_w4.tools"))
    assert not bad, "library modules importing hf_w4.tools: " + ", ".join(bad)


def test_import_and_load_leave_tools_unloaded(tmp_path):
    """``import hf_w4``, install, and loading a quantized model through from_pretrained load no tools module."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    from hf_w4.tools import writers
    writers.write_checkpoint(tmp_path / "dense", tmp_path / "gptq", "gptq", group_size=32)
    code = ("import sys, hf_w4, transformers\n"
            "hf_w4.install()\n"
            f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'gptq')!r})\n"
            "assert any(isinstance(x, hf_w4.QuantLinear) for x in m.modules())\n"
            "print(sorted(n for n in sys.modules if n.startswith('hf_w4.tools')))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
