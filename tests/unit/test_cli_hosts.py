import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dflash_ops
from dflash_ops.cli import app
from dflash_ops.transport.local import LocalTransport

runner = CliRunner()
ARGS = ["it's", "$(id)", "{i}: {lines[i]}"]
CODE = "import json,sys; print(json.dumps(sys.argv[1:]))"


def test_exec_round_trips_argv(sim_inventory):
    result = runner.invoke(app, ["exec", "--inventory", str(sim_inventory), "host200", "--", "python3", "-c", CODE, *ARGS])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == ARGS


def test_exec_without_separator_and_exit_status(sim_inventory):
    result = runner.invoke(app, ["exec", "--inventory", str(sim_inventory), "host200", "sh", "-c", "echo hi; exit 9"])
    assert (result.exit_code, result.stdout) == (9, "hi\n")


def test_print_command_shows_every_layer_and_runs_nothing(sim_inventory, tmp_path):
    marker = tmp_path / "ran"
    result = runner.invoke(app, ["exec", "--inventory", str(sim_inventory), "--print-command", "host200", "--",
                                 "touch", str(marker), "it's"])
    assert result.exit_code == 0
    lines = printed_layers(result.stdout)
    assert lines["command"] == repr(["touch", str(marker), "it's"])
    assert lines["node command (sent over SSH)"].endswith(f" touch {marker} 'it'\"'\"'s'")
    assert not marker.exists()


def printed_layers(stdout: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in stdout.splitlines())


TAG = re.compile(r"DFLASH_OPS_EXEC=[0-9a-f]{32}")


@pytest.mark.parametrize("timeout", [[], ["--timeout", "30"]], ids=["no-timeout", "timeout"])
def test_print_command_is_what_runs(sim_inventory, monkeypatch, timeout):
    """The printed layers are the command the transport is handed (the tag token is fresh each run),
    and nothing of the operator's environment (a secret in HF_TOKEN) is in either."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_to_be_shown")
    argv = ["exec", "--inventory", str(sim_inventory), *timeout, "host200", "--", "sh", "-c", "echo hi"]
    printed = runner.invoke(app, [*argv[:3], "--print-command", *argv[3:]])
    assert printed.exit_code == 0, printed.output
    layers = printed_layers(printed.stdout)
    sent: list[str] = []
    real_run = LocalTransport.run

    def recording(self, command, **kwargs):
        sent.append(command)
        return real_run(self, command, **kwargs)

    monkeypatch.setattr(LocalTransport, "run", recording)
    ran = runner.invoke(app, argv)
    assert (ran.exit_code, ran.stdout) == (0, "hi\n")
    assert len(sent) == 1
    token = TAG.search(layers["tag"]).group(0)
    assert token in layers["container argv"] and token in layers["node command (sent over SSH)"]
    assert TAG.sub("TAG", layers["node command (sent over SSH)"]) == TAG.sub("TAG", sent[0])
    assert ("timeout --kill-after=5 30 " in sent[0]) == bool(timeout)
    assert "hf_not_to_be_shown" not in printed.output + sent[0]


def test_options_after_target_are_ours_and_argv_after_separator_is_untouched(sim_inventory, tmp_path):
    marker = tmp_path / "ran"
    result = runner.invoke(app, ["exec", "host200", "--inventory", str(sim_inventory), "--print-command", "--",
                                 "touch", str(marker), "--print-command"])
    assert result.exit_code == 0
    assert result.stdout.splitlines()[0] == "command: " + repr(["touch", str(marker), "--print-command"])
    assert not marker.exists()


def test_env_var_inventory_and_timeout(sim_inventory):
    result = runner.invoke(app, ["exec", "--timeout", "0.5", "host200", "--", "sleep", "30"],
                           env={"DFLASH_OPS_INVENTORY": str(sim_inventory)})
    assert result.exit_code == 124 and "timed out" in result.stderr


def test_inventory_typo_is_one_clean_line(tmp_path):
    bad = tmp_path / "hosts.yaml"
    bad.write_text("nodes:\n  n: {transport: local, pct: simulated}\ntargets:\n  t:\n    node: n\n    ctdi: 200\n    base_dir: /x\n")
    result = runner.invoke(app, ["hosts", "--inventory", str(bad)])
    assert result.exit_code == 1
    assert result.stderr == f"dflash-ops: error: {bad}:6: target 't': unknown key 'ctdi' (did you mean 'ctid'?)\n"


def test_hosts_table(sim_inventory):
    result = runner.invoke(app, ["hosts", "--inventory", str(sim_inventory)])
    assert result.exit_code == 0
    row = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("host200")][0]
    assert row[:3] == ["host200", "sim", "200"] and row[-2:] == ["running", "never"]


def test_inspect_source(sim_inventory):
    result = runner.invoke(app, ["inspect-source", "--inventory", str(sim_inventory), "host200", "json.decoder",
                                 "--lines", "2:3"])
    assert result.exit_code == 0
    out = result.stdout.splitlines()
    assert out[0].startswith("# ") and out[0].endswith("json/decoder.py")
    source = Path(out[0][2:]).read_text().splitlines()
    assert out[1:] == [f"2  {source[1]}", f"3  {source[2]}"]
    bad = runner.invoke(app, ["inspect-source", "--inventory", str(sim_inventory), "host200", "no_such_mod_q"])
    assert bad.exit_code == 3 and "no module named 'no_such_mod_q'" in bad.stderr
    bad_range = runner.invoke(app, ["inspect-source", "--inventory", str(sim_inventory), "host200", "json",
                                    "--lines", "9:3"])
    assert bad_range.exit_code == 2 and "bad --lines" in bad_range.stderr


def test_python_dash_m_subprocess(sim_inventory):
    env = dict(os.environ, PYTHONPATH=str(Path(dflash_ops.__file__).resolve().parent.parent),
               DFLASH_OPS_INVENTORY=str(sim_inventory))
    proc = subprocess.run([sys.executable, "-m", "dflash_ops", "exec", "host200", "--", "python3", "-c", CODE, *ARGS],
                          env=env, capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ARGS
    proc = subprocess.run([sys.executable, "-m", "dflash_ops", "exec", "nohost", "--", "true"], env=env,
                          capture_output=True, text=True, cwd="/")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_node_that_is_not_an_ssh_server_is_one_clean_line(tmp_path):
    """Paramiko's transport thread logs a traceback on a bad banner; the user sees one line."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def answer_and_hang_up():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # the test closed the server
                return
            conn.sendall(b"HTTP/1.0 400 Bad Request\r\n")
            conn.close()

    threading.Thread(target=answer_and_hang_up, daemon=True).start()
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(f"nodes:\n  n: {{transport: ssh, address: 127.0.0.1, port: {server.getsockname()[1]}}}\n"
                         "targets:\n  t: {node: n, ctid: 200, base_dir: /opt/dflash}\n")
    env = dict(os.environ, PYTHONPATH=str(Path(dflash_ops.__file__).resolve().parent.parent), HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "dflash_ops", "exec", "--inventory", str(inventory), "t", "--", "true"],
                          capture_output=True, text=True, env=env)
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    assert proc.returncode == 255
    assert proc.stderr.startswith("dflash-ops: error: node 'n': cannot connect to 127.0.0.1")
    assert proc.stderr.count("\n") == 1, proc.stderr
