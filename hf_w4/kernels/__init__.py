"""Kernels and their registry (``python -m hf_w4.kernels`` prints the support matrix)."""
from .base import Kernel
from .registry import by_name, kernels, register, select, support_matrix

__all__ = ["Kernel", "by_name", "kernels", "register", "select", "support_matrix"]
