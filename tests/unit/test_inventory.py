import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import dflash_ops
from dflash_ops.errors import InventoryError
from dflash_ops.inventory import default_inventory_path, load_inventory

REPO = Path(dflash_ops.__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    return path


GOOD = """\
nodes:
  pve1:
    transport: ssh
    address: 10.1.2.6
    pct: sudo pct
targets:
  host200:
    node: pve1
    ctid: 200
    base_dir: /opt/dflash
    gpus: [0, 1]
"""


def test_default_inventory_is_the_simulated_node(monkeypatch):
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    assert default_inventory_path() == REPO / "inventory" / "hosts.yaml"
    target = load_inventory().target("host200")
    assert target.ctid == 200 and target.node.transport == "local" and target.node.kind.identity()
    # a directory container lives under the operator's home; a real LXC container has its own rootfs
    if target.node.kind.backend(200) == "lxc":
        assert target.base_dir == "/opt/dflash"
    else:
        assert target.base_dir.startswith(str(Path.home()))


def test_packaged_copy_matches_repository_inventory():
    assert (REPO / "dflash_ops" / "data" / "hosts.yaml").read_text() == (REPO / "inventory" / "hosts.yaml").read_text()


def test_example_proxmox_inventory_loads():
    inv = load_inventory(REPO / "inventory" / "example-proxmox.yaml")
    target = inv.target("host200")
    assert target.node.address == "10.1.2.6" and target.node.pct == ("pct",)
    assert target.gpus == (0, 1, 2, 3, 4, 5, 6, 7) and target.node.strict_host_key_checking


def test_env_var_overrides_default(tmp_path, monkeypatch):
    path = write(tmp_path, GOOD)
    monkeypatch.setenv("DFLASH_OPS_INVENTORY", str(path))
    inv = load_inventory()
    assert inv.path == path and inv.target("host200").node.pct == ("sudo", "pct")


ERRORS = yaml.safe_load((Path(__file__).resolve().parents[1] / "fixtures" / "inventory_errors.yaml").read_text())


@pytest.mark.parametrize("case", ERRORS, ids=[case["error"].split(": ", 1)[1] for case in ERRORS])
def test_errors_name_file_line_and_problem(tmp_path, case):
    assert case["old"] in GOOD
    path = write(tmp_path, GOOD.replace(case["old"], case["new"]))
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    text = str(info.value)
    assert text.startswith(str(tmp_path)) and case["error"] in text
    assert "\n" not in text


def test_deploy_options_of_a_target(tmp_path):
    text = GOOD.replace("gpus: [0, 1]", "gpus: [0, 1]\n    extra_paths: [docs]\n    keep_releases: 2\n"
                        "    venv: {requirements: trainer/requirements.txt, system_site_packages: false}")
    target = load_inventory(write(tmp_path, text)).target("host200")
    assert target.extra_paths == ("docs",) and target.keep_releases == 2
    assert target.venv_config == {"requirements": "trainer/requirements.txt", "system_site_packages": False}
    no_venv = load_inventory(write(tmp_path, GOOD.replace("gpus: [0, 1]", "gpus: [0, 1]\n    venv: false")))
    assert no_venv.target("host200").venv_config is False


def test_unknown_target_suggests(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD))
    with pytest.raises(InventoryError, match=r"no target 'host20' \(did you mean 'host200'\?\)"):
        inv.target("host20")


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(InventoryError, match="cannot read inventory"):
        load_inventory(tmp_path / "nope.yaml")


def test_an_inventory_of_real_pct_nodes_does_not_import_the_simulated_node(tmp_path):
    """The node-kind registry is lazy: a kind's module is imported only when a node names it."""
    code = ("import sys\nfrom dflash_ops.inventory import load_inventory\n"
            f"inv = load_inventory({str(write(tmp_path, GOOD))!r})\n"
            "assert inv.target('host200').ctid == 200\n"
            "print(sorted(m for m in sys.modules if m.startswith('dflash_ops.simnode')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sim_containers_only_on_simulated_nodes(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text("nodes:\n  n:\n    transport: local\n    pct: pct\n    sim_containers: [200]\n"
                    "targets: {}\n")
    with pytest.raises(InventoryError, match=r"inv.yaml:5: node 'n': 'sim_containers' only applies to nodes with pct: simulated"):
        load_inventory(path)
    path.write_text("nodes:\n  n:\n    transport: local\n    pct: simulated\n    sim_containers: [12]\n"
                    "targets: {}\n")
    with pytest.raises(InventoryError, match=r"inv.yaml:5: .*sim_containers\[0\] must be greater than or equal to 100, got 12"):
        load_inventory(path)


NOTIFY = """\
nodes:
  pve1:
    transport: ssh
    address: 10.1.2.6
    notify:
      webhooks: [env:H39_NODE_HOOK]
      checkpoints: true
targets:
  host200:
    node: pve1
    ctid: 200
    base_dir: /opt/dflash
    notify:
      webhooks: [https://hooks.example.com/T0/s3cret]
      commands: [[/usr/local/bin/page, --quiet]]
      local: [[notify-send, dflash-ops]]
"""


def test_notify_of_a_node_and_its_target_add_up(tmp_path, monkeypatch):
    from dflash_ops.inventory import resolved_webhooks

    target = load_inventory(write(tmp_path, NOTIFY)).target("host200")
    wanted = target.notify_all
    assert wanted.webhooks == ("env:H39_NODE_HOOK", "https://hooks.example.com/T0/s3cret")
    assert wanted.commands == (("/usr/local/bin/page", "--quiet"),) and wanted.local == (("notify-send", "dflash-ops"),)
    assert wanted.checkpoints  # the node's asks for the optional checkpoint events
    monkeypatch.delenv("H39_NODE_HOOK", raising=False)
    with pytest.raises(InventoryError, match="H39_NODE_HOOK is not set"):
        resolved_webhooks(wanted)
    monkeypatch.setenv("H39_NODE_HOOK", "https://node.example.com/x")
    assert resolved_webhooks(wanted, ["https://node.example.com/x", "http://127.0.0.1:9/y"]) == [
        "https://node.example.com/x", "https://hooks.example.com/T0/s3cret", "http://127.0.0.1:9/y"]


@pytest.mark.parametrize("body, line, message", [
    ("notify: {webhooks: [ftp://h/s3cret]}", 12, "webhooks[0] must be an http(s):// URL or env:NAME, got 'ftp://h/…'"),
    ("notify: {hooks: []}", 12, "unknown key 'hooks'"),
    ("notify: {commands: [[]]}", 12, "commands"),
    ("notify: [https://h/x]", 12, "notify must be a mapping"),
    ("notify: {checkpoints: often}", 12, "checkpoints"),
])
def test_notify_errors_name_the_line_and_never_the_secret(tmp_path, body, line, message):
    text = GOOD + "    " + body + "\n"
    with pytest.raises(InventoryError) as e:
        load_inventory(write(tmp_path, text))
    assert f"hosts.yaml:{line}: target 'host200': notify" in str(e.value), str(e.value)
    assert message in str(e.value) and "s3cret" not in str(e.value)


def test_every_registered_node_kind_resolves_to_a_factory():
    from dflash_ops import nodekinds

    for name in nodekinds.KINDS:
        assert issubclass(nodekinds.factory(name), nodekinds.KindFactory), name
    assert set(nodekinds.kind_keys()) == {"simulated"}
