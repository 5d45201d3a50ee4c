"""hf_w4's log messages and progress bars are transformers' own, so transformers' switches reach them:

* messages go to the ``transformers.hf_w4`` logger, a child of transformers' library logger:
  ``transformers.logging.set_verbosity_info()`` / ``set_verbosity_error()`` and ``TRANSFORMERS_VERBOSITY=info``
  show or hide them with transformers' own;
* progress bars are ``transformers.utils.logging.tqdm``: ``transformers.logging.disable_progress_bar()`` (or
  ``HF_HUB_DISABLE_PROGRESS_BARS=1``) hides them together with transformers' "Loading weights" bars.

:func:`set_verbosity` is the one switch for both (the ``hf-w4`` command's ``--quiet`` / ``--verbose``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

from transformers.utils import logging as _tlog

NAME = "transformers.hf_w4"
logger = _tlog.get_logger(NAME)

LEVELS = {"error": _tlog.ERROR, "warning": _tlog.WARNING, "info": _tlog.INFO, "debug": _tlog.DEBUG}


def progress(iterable=None, **kwargs):
    """A progress bar on stderr (``tqdm`` arguments) that ``disable_progress_bar()`` turns off."""
    kwargs.setdefault("leave", False)
    return _tlog.tqdm(iterable, **kwargs)


def set_verbosity(level: str, progress_bars: Optional[bool] = None) -> None:
    """Set transformers' verbosity (and so hf_w4's) to ``level`` (error, warning, info, debug) and show or hide
    progress bars: by default hidden at ``error``, shown otherwise."""
    if level not in LEVELS:
        raise ValueError(f"verbosity {level!r} is not one of {sorted(LEVELS)}")
    _tlog.set_verbosity(LEVELS[level])
    if progress_bars is None:
        progress_bars = level != "error"
    (_tlog.enable_progress_bar if progress_bars else _tlog.disable_progress_bar)()


@contextlib.contextmanager
def hidden_progress_bars(hide: bool = True):
    """Within the block, no progress bar at all (transformers' "Loading weights" bars included) when ``hide``;
    afterwards as before. ``hide=False`` changes nothing (the global switch decides)."""
    was = _tlog.is_progress_bar_enabled()
    if hide:
        _tlog.disable_progress_bar()
    try:
        yield
    finally:
        if hide and was:
            _tlog.enable_progress_bar()
