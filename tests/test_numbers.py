"""One numeric validator for hvps's flags (hvps.core.numbers), and NVML's one "call or None"."""

from __future__ import annotations

import argparse

import pytest

from hvps.core.numbers import non_negative, non_negative_float, number, positive, positive_float
from hvps.doctor.cli import register
from hvps.metrics.nvml import maybe
from hvps.runner.settings import parse_args

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("parse,text,value", [
    (positive, "3", 3), (non_negative, "0", 0), (non_negative_float, "0", 0.0), (positive_float, "0.5", 0.5),
    (number(int, minimum=2), "2", 2),
])
def test_accepts(parse, text, value):
    assert parse(text) == value and type(parse(text)) is type(value)


@pytest.mark.parametrize("parse,text,message", [
    (positive, "0", "'0' must be >= 1"), (positive, "x", "'x' is not a whole number"),
    (positive, "1.5", "'1.5' is not a whole number"), (non_negative, "-1", "'-1' must be >= 0"),
    (non_negative_float, "-0.1", "'-0.1' must be >= 0"), (positive_float, "0", "'0' must be > 0"),
    (positive_float, "fast", "'fast' is not a number"),
])
def test_refuses_with_one_line(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{message}$"):
        parse(text)


def test_hvpsrun_and_the_doctor_share_it(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--min-np", "0", "python", "t.py"])
    assert "argument --min-np/--min-num-proc: '0' must be >= 1" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="hvps")
    register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["doctor", "--ranks-per-node", "0"])
    assert "argument --ranks-per-node: '0' must be >= 1" in capsys.readouterr().err


def test_nvml_call_or_none():
    def unsupported(_handle):
        raise RuntimeError("NVMLError_NotSupported")

    assert maybe(lambda h, k: (h, k), 1, 2) == (1, 2)
    assert maybe(unsupported, object()) is None
    assert maybe(None, object()) is None  # a pynvml too old to have the function
