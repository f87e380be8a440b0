import pytest
import typer

from dflash_ops.cli.dash import parse_local


def test_parse_local_names_bad_specs(tmp_path):
    assert parse_local([f"sim={tmp_path}"]) == {"sim": tmp_path}
    with pytest.raises(typer.BadParameter, match="NAME=BASE_DIR"):
        parse_local(["no-equals-sign"])


def test_inventory_source_checks_targets_up_front(sim_inventory):
    from dflash_ops.cli.dash import inventory_source
    from dflash_ops.errors import InventoryError

    assert inventory_source(sim_inventory, []).targets() == ["host200"]
    with pytest.raises(InventoryError, match="no target 'host201'"):  # one line at the CLI's entry
        inventory_source(sim_inventory, ["host201"])


def test_dash_cli_names_an_unknown_target(sim_inventory):
    from typer.testing import CliRunner

    from dflash_ops.cli import app

    result = CliRunner().invoke(app, ["dash", "--inventory", str(sim_inventory), "host999"])
    assert result.exit_code == 1
    assert "no target 'host999'" in result.output


def test_an_unreachable_node_is_a_library_error_in_the_worker(tmp_path):
    """Not typer.Exit: the dashboard's threads show DflashOpsError/TransportError and retry."""
    from dflash_ops.cli.dash import inventory_source
    from dflash_ops.errors import DflashOpsError

    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        "nodes:\n  far: {transport: ssh, address: 127.0.0.1, port: 1, user: nobody,"
        f" known_hosts: {tmp_path / 'known_hosts'}}}\n"
        "targets:\n  host200: {node: far, ctid: 200, base_dir: /opt/dflash}\n"
    )
    source = inventory_source(inventory, [])
    with pytest.raises(DflashOpsError):
        source.list_runs("host200")
