"""`nanoqwen-cli inspect` and `verify` on a small real container, a corrupted one and a missing file."""

from __future__ import annotations

import json
import re

import nanoqwen_format as nqf
import numpy as np
import pytest
from nanoqwen_cli.main import app
from typer.testing import CliRunner

runner = CliRunner()


@pytest.fixture
def model(tmp_path):
    rng = np.random.default_rng(11)
    path = tmp_path / "m.nanoqwen"
    with nqf.Writer(path) as w:
        w.add_array("final_norm", rng.standard_normal(96).astype(np.float32))
        w.add_quantized("layers.0.qkv", nqf.int4.quantize_rtn(rng.standard_normal((24, 256)), 64, False))
        w.add_quantized("lm_head", nqf.int8.quantize_rtn(rng.standard_normal((10, 128)), 32))
        w.set_metadata({"config": {"hidden_size": 96}, "tokenizer": "t" * 5000, "chat_template": "[x]"})
    return path


def test_no_args_shows_help():
    result = runner.invoke(app, [])
    assert "inspect" in result.output and "verify" in result.output


def test_inspect_table_in_a_wide_terminal(model):
    """A terminal (rich's TTY_COMPATIBLE=1) of 200 columns: every column of the tensor table."""
    result = runner.invoke(app, ["inspect", str(model)], env={"COLUMNS": "200", "TTY_COMPATIBLE": "1"})
    assert result.exit_code == 0, result.output
    assert "layers.0.qkv" in result.output and "int4-g64-tile8x128-v1 asym" in result.output
    assert "24x256" in result.output and "int8-g32-rowmajor-v1 sym" in result.output
    assert '"chars": 5000' in result.output  # the tokenizer is summarised, not dumped
    with nqf.open(model) as f:
        rec = f.records["layers.0.qkv"]
        assert f"{rec.checksum:016x}" in result.output and f"{rec.offset:,}" in result.output
    assert "left out" not in result.output
    plain = re.sub(r"\x1b\[[0-9;]*m", "", result.output)  # the terminal's styles
    assert max(map(len, plain.splitlines())) <= 200
    assert '"[x]"' in plain  # metadata is text, not rich markup


@pytest.mark.parametrize("env", [{}, {"COLUMNS": "200"}], ids=["pipe", "pipe-with-COLUMNS"])
def test_inspect_table_fits_80_columns_in_a_pipe(model, env):
    """stdout not a terminal: 80 columns whatever COLUMNS says; the checksum column is left out (--json
    has it), saying so, and nothing else is cut."""
    result = runner.invoke(app, ["inspect", str(model)], env=env)
    assert result.exit_code == 0, result.output
    assert max(map(len, result.output.splitlines())) <= 80, result.output
    assert "int4-g64-tile8x128-v1 asym" in result.output and "int8-g32-rowmajor-v1 sym" in result.output
    with nqf.open(model) as f:
        assert f"{f.records['layers.0.qkv'].checksum:016x}" not in result.output
    assert "(xxh3 left out at 80 columns: --json or a wider terminal shows them)" in result.output
    assert "…" not in result.output  # no cell truncated
    assert '"[x]"' in result.output


def test_fit_columns_drops_in_order_until_the_rest_fit():
    from nanoqwen_cli.container_commands import fit_columns

    headers = ["a", "b", "c"]
    rows = [["x" * 10, "y" * 10, "z" * 10]]
    assert fit_columns(headers, rows, 36, ["c", "b"], gap=3) == ["a", "b", "c"]  # 30 + 2 gaps of 3
    assert fit_columns(headers, rows, 35, ["c", "b"], gap=3) == ["a", "b"]
    assert fit_columns(headers, rows, 12, ["c", "b"], gap=3) == ["a"]
    assert fit_columns(headers, rows, 34, ["c", "b"]) == ["a", "b", "c"]  # the table's gap: 2


def test_inspect_json(model):
    result = runner.invoke(app, ["inspect", str(model), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    with nqf.open(model) as f:
        assert [t["name"] for t in info["tensors"]] == list(f.records)
        qkv = next(t for t in info["tensors"] if t["name"] == "layers.0.qkv")
        rec = f.records["layers.0.qkv"]
        assert qkv["shape"] == [24, 256] and qkv["nbytes"] == rec.nbytes and qkv["offset"] == rec.offset
        assert qkv["xxh3"] == f"{rec.checksum:016x}" and qkv["symmetric"] is False and qkv["group_size"] == 64
    assert info["version"] == f"{nqf.spec.MAJOR}.{nqf.spec.MINOR}"
    assert info["metadata"]["tokenizer"] == {"chars": 5000}
    assert info["metadata"]["chat_template"] == "[x]" and info["file_bytes"] == model.stat().st_size


def test_verify_ok(model):
    result = runner.invoke(app, ["verify", str(model)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK ") and "3 tensors" in result.output


def test_verify_reports_corrupt_tensor(model):
    with nqf.open(model) as f:
        off = f.records["layers.0.qkv"].offset
    data = bytearray(model.read_bytes())
    data[off + 100] ^= 1
    model.write_bytes(bytes(data))
    result = runner.invoke(app, ["verify", str(model)])
    assert result.exit_code == 1
    assert "ChecksumError" in result.output and "layers.0.qkv" in result.output


def test_verify_reports_truncation_and_missing_file(model, tmp_path):
    model.write_bytes(model.read_bytes()[:-10])
    result = runner.invoke(app, ["verify", str(model)])
    assert result.exit_code == 1 and "TruncatedError" in result.output
    result = runner.invoke(app, ["inspect", str(tmp_path / "absent.nanoqwen")])
    assert result.exit_code == 1 and "no such file" in result.output
    result = runner.invoke(app, ["verify", str(tmp_path)])  # a folder, not a file
    assert result.exit_code == 1 and "is a folder, not a .nanoqwen container" in result.output
