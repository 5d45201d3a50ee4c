"""Kernel selection: declared capabilities, reasons, force/deny knobs, the reference fallback warning."""
import logging

import pytest
import torch

from hf_w4.formats.spec import W4Spec
from hf_w4.kernels import base, registry
from hf_w4.kernels.reference import TorchReferenceKernel

SPEC = W4Spec("awq", "awq", "int4", 4, 128, True)
CPU = torch.device("cpu")


def test_every_kernel_declares_its_capabilities():
    for k in registry.kernels():
        assert k.NAME and k.DEVICES and k.WEIGHT_TYPES and k.ACTIVATIONS and k.DESCRIPTION, k
        ok, why = k.is_supported()
        assert isinstance(ok, bool) and (ok or why), k


def test_force_and_deny(monkeypatch):
    monkeypatch.delenv("HF_W4_KERNEL", raising=False)
    cls, _ = registry.select(SPEC, 256, 256, CPU, torch.float32, force="torch_reference")
    assert cls is TorchReferenceKernel
    others = [k.NAME for k in registry.kernels() if k is not TorchReferenceKernel]
    cls, reasons = registry.select(SPEC, 256, 256, CPU, torch.float32, deny=others)
    assert cls is TorchReferenceKernel
    assert all("disabled" in reasons[n] for n in others)
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        registry.select(SPEC, 256, 256, CPU, torch.float32, force="nope")
    with pytest.raises(ValueError, match="disabled_kernels / HF_W4_DISABLED_KERNELS: unknown kernel 'cpu-w4a16'"):
        registry.select(SPEC, 256, 256, CPU, torch.float32, deny=("cpu-w4a16",))
    monkeypatch.setenv("HF_W4_DISABLED_KERNELS", "bogus")
    with pytest.raises(ValueError, match="unknown kernel 'bogus'"):
        registry.select(SPEC, 256, 256, CPU, torch.float32)


def test_env_knobs(monkeypatch):
    monkeypatch.setenv("HF_W4_KERNEL", "torch_reference")
    assert registry.select(SPEC, 256, 256, CPU, torch.float32)[0] is TorchReferenceKernel
    assert registry.select(SPEC, 256, 256, CPU, torch.float32, force="auto")[0] is TorchReferenceKernel
    monkeypatch.delenv("HF_W4_KERNEL")
    monkeypatch.setenv("HF_W4_DISABLED_KERNELS", ",".join(k.NAME for k in registry.kernels()))
    with pytest.raises(ValueError, match="(?s)no kernel can run .*torch_reference: disabled"):
        registry.select(SPEC, 256, 256, CPU, torch.float32, name="model.layers.0.q_proj")


class _Fake(base.Kernel):
    NAME, PRIORITY, WEIGHT_TYPES, DESCRIPTION = "fake_fast", 1000, frozenset({"nvfp4"}), "test double"


def test_rejections_carry_reasons_and_reference_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", registry.kernels() + [_Fake])
    registry._KERNELS.sort(key=lambda c: -c.PRIORITY)
    registry._warned.clear()
    with caplog.at_level(logging.WARNING, logger="hf_w4"):
        for _ in range(3):
            cls, reasons = registry.select(SPEC, 256, 256, CPU, torch.float32, deny=[
                k.NAME for k in registry.kernels() if k not in (_Fake, TorchReferenceKernel)])
    assert cls is TorchReferenceKernel
    assert reasons["fake_fast"] == "weight type int4 not in ['nvfp4']"
    assert sum("no fast kernel can run" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="kernel 'fake_fast' was forced .* weight type int4 not in"):
        registry.select(SPEC, 256, 256, CPU, torch.float32, force="fake_fast")


def test_support_matrix_is_generated():
    m = registry.support_matrix()
    for k in registry.kernels():
        assert f"| {k.NAME} |" in m


def test_registry_order_is_priority_then_name():
    # equal priorities (cpu_int8, cpu_w4a16) must not be ordered by import order: the docs/usage.md table is compared
    # verbatim, and the test modules import the kernel modules in different orders
    ks = registry.kernels()
    assert ks == sorted(ks, key=lambda c: (-c.PRIORITY, c.NAME))


def test_docs_matrix_is_generated_from_the_registry():
    import pathlib
    usage = (pathlib.Path(__file__).parents[2] / "docs" / "usage.md").read_text()
    assert registry.support_matrix(status=False) in usage, \
        "docs/usage.md's kernel table is stale: paste the output of `python -m hf_w4.kernels --readme`"


def test_kernel_without_its_ops_says_why():
    class NeedsOps(base.Kernel):
        NAME, WEIGHT_TYPES, DESCRIPTION, REQUIRES_OPS = "needs_ops", frozenset({"int4"}), "t", ("no_such_op",)
    ok, why = NeedsOps.is_supported()
    assert not ok and "has no no_such_op" in why
    assert NeedsOps.can_implement(SPEC, 256, 256, CPU, torch.float32) == (False, why)
