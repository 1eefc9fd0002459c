"""`loraloom tokenizer`: the built-in model's tokenizer as Hugging Face files, where the Tinker SDK's
`get_tokenizer()` (AutoTokenizer.from_pretrained of `get_info`'s `tokenizer_id`, "loraloom-tiny")
finds it from the user's working directory."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from contracts.tokenizer import CharTokenizer
from loraloom.cli import cli

runner = CliRunner()


def test_it_writes_a_tokenizer_that_transformers_loads_offline(tmp_path, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(cli, ["tokenizer"])
    assert result.exit_code == 0, result.output
    assert "loraloom-tiny" in result.output
    # the name get_info gives, resolved from the working directory as the SDK does
    loaded = transformers.AutoTokenizer.from_pretrained("loraloom-tiny")
    text = "12+30=42"
    assert loaded.encode(text, add_special_tokens=False) == CharTokenizer().encode(text)
    # a second run (the files already there) is fine and changes nothing
    before = {p.name: p.read_bytes() for p in (tmp_path / "loraloom-tiny").iterdir()}
    assert runner.invoke(cli, ["tokenizer"]).exit_code == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "loraloom-tiny").iterdir()} == before


def test_a_path_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.write_text("mine")
    result = runner.invoke(cli, ["tokenizer", str(target)])
    assert result.exit_code == 2
    assert "is not a directory" in result.output
    assert target.read_text() == "mine"


def test_an_unwritable_place_is_an_error_naming_it(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    (parent / "loraloom-tiny").write_text("")  # a file where the directory's parent should be
    result = runner.invoke(cli, ["tokenizer", str(parent / "loraloom-tiny" / "sub")])
    assert result.exit_code == 1
    assert "cannot write the tokenizer into" in result.output and "sub" in result.output
