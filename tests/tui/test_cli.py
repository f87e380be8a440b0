import pytest
import typer

from dflash_ops.cli.dash import parse_local


def test_parse_local_names_bad_specs(tmp_path):
    assert parse_local([f"sim={tmp_path}"]) == {"sim": tmp_path}
    with pytest.raises(typer.BadParameter, match="NAME=BASE_DIR"):
        parse_local(["no-equals-sign"])
