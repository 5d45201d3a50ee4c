"""Change a module right after it is first imported, without importing it now (importing transformers' model
code or PEFT costs seconds): ``when_imported("peft.tuners.lora.model", patch)``."""
from __future__ import annotations

import sys
from typing import Callable


def when_imported(name: str, patch: Callable) -> None:
    """Call ``patch(module)`` now if module ``name`` is imported, else right after its first import. Idempotent per
    (name, patch) while the import is pending."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _ImportHook) and f.name == name and f.patch is patch for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook(name, patch))


class _ImportHook:
    """A ``sys.meta_path`` finder that patches module ``name`` right after it is first executed, then removes
    itself (importlib's ABCs are left out: importing them costs more than the rest of ``import hf_w4``)."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        import importlib.util
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


class _PatchingLoader:
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)
