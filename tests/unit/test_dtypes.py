"""The one dtype table: every name maps to torch's dtype of that name with the bytes the table
says; the model dtypes the config and the dtypes a KVLayout may name are the table's; bad names
and dtypes the table does not hold are refused by name."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from helixserve import dtypes
from helixserve.config import DType
from helixserve.engine.llm import resolve_dtype
from helixserve.protocol.disagg import DType as WireDType


@pytest.mark.parametrize("name", sorted(dtypes.ITEMSIZE))
def test_each_name_is_torchs_dtype_with_its_itemsize(name):
    dtype = dtypes.torch_dtype(name)
    assert dtype is getattr(torch, name)
    assert dtypes.itemsize(name) == torch.empty((), dtype=dtype).element_size()
    assert dtypes.dtype_name(dtype) == name


def test_config_and_wire_literals_are_the_tables_names():
    assert set(typing.get_args(DType)) == set(dtypes.MODEL_DTYPES)
    assert set(typing.get_args(WireDType)) == set(dtypes.ITEMSIZE)


@pytest.mark.parametrize("bad", ["float64", "bf16", "", "torch.float32"])
def test_unknown_names_are_refused_by_name(bad):
    for call in (dtypes.itemsize, dtypes.torch_dtype, dtypes.check_dtype):
        with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
            call(bad)


def test_a_wire_only_dtype_is_not_a_model_dtype():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        resolve_dtype("float8_e4m3fn", torch.device("cpu"))
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


def test_a_dtype_outside_the_table_has_no_name():
    with pytest.raises(ValueError, match="float64"):
        dtypes.dtype_name(torch.float64)


def test_the_table_imports_without_torch():
    code = "import sys, helixserve.dtypes; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_there_is_one_table():
    """No other module of helixserve spells a name -> torch dtype map."""
    root = Path(__file__).resolve().parents[2] / "helixserve"
    twins = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.name != "dtypes.py"
             and ('"bfloat16": torch.bfloat16' in p.read_text() or '"float32": 4' in p.read_text())]
    assert twins == [], twins
