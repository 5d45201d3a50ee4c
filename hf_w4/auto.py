"""``import hf_w4.auto`` installs hf_w4's takeover of the 4-bit quant methods (for scripts and notebooks,
e.g. each ``accelerate launch`` rank)."""
from .integration import install

install()
