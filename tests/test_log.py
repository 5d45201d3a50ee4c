"""hf_w4's messages and progress bars follow transformers' switches (and hf_w4.log.set_verbosity, which sets both)."""
import logging
import os
import subprocess
import sys

import pytest
from transformers.utils import logging as tlog

from hf_w4 import log


@pytest.fixture(autouse=True)
def _restore():
    level, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    yield
    tlog.set_verbosity(level)
    (tlog.enable_progress_bar if bars else tlog.disable_progress_bar)()


def test_transformers_verbosity_reaches_hf_w4():
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    tlog.add_handler(handler)               # on transformers' library logger, as its own stderr handler
    try:
        tlog.set_verbosity_info()
        log.logger.info("hf_w4: shown")
        tlog.set_verbosity_error()
        log.logger.warning("hf_w4: hidden")
    finally:
        tlog.remove_handler(handler)
    assert seen == ["hf_w4: shown"]


def test_transformers_verbosity_variable_reaches_hf_w4():
    code = "from hf_w4.log import logger; logger.warning('hf_w4: a warning'); logger.info('hf_w4: some info')"
    run = lambda v: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                   env={**os.environ, "TRANSFORMERS_VERBOSITY": v}).stderr
    assert "a warning" not in run("error")
    quiet, loud = run("warning"), run("info")
    assert "a warning" in quiet and "some info" not in quiet and "some info" in loud


def test_disable_progress_bar_reaches_hf_w4(capfd):
    tlog.enable_progress_bar()
    list(log.progress(range(3), desc="hf_w4 bar", leave=True, mininterval=0))
    assert "hf_w4 bar" in capfd.readouterr().err
    tlog.disable_progress_bar()
    list(log.progress(range(3), desc="hf_w4 bar", leave=True, mininterval=0))
    assert "hf_w4 bar" not in capfd.readouterr().err


def test_one_switch_sets_both():
    log.set_verbosity("error")
    assert tlog.get_verbosity() == tlog.ERROR and not tlog.is_progress_bar_enabled()
    log.set_verbosity("info")
    assert tlog.get_verbosity() == tlog.INFO and tlog.is_progress_bar_enabled()
    log.set_verbosity("warning", progress_bars=False)
    assert not tlog.is_progress_bar_enabled()
    with pytest.raises(ValueError, match="verbosity 'loud' is not one of"):
        log.set_verbosity("loud")
