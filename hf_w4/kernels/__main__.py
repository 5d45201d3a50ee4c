"""python -m hf_w4.kernels [--readme]: the kernel support matrix, generated from the registry's declarations."""
import sys

from .registry import support_matrix

print(support_matrix(status="--readme" not in sys.argv[1:]))
