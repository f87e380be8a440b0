import shlex
import subprocess

import pytest
from hypothesis import given, settings

from dflash_ops import render
from tests.container_checks import argv_strategy


def test_pct_exec_layers():
    r = render.pct_exec(("sudo", "pct"), 200, ["python3", "-c", "print('hi')"])
    assert r.argv == ("python3", "-c", "print('hi')")
    assert r.pct_argv == ("sudo", "pct", "exec", "200", "--", "python3", "-c", "print('hi')")
    assert r.command == "sudo pct exec 200 -- python3 -c 'print('\"'\"'hi'\"'\"')'"
    assert [label for label, _ in r.layers()] == ["container argv", "pct layer", "node command (sent over SSH)"]


@settings(max_examples=200, deadline=None)
@given(argv_strategy())
def test_node_command_parses_back_to_the_argv(argv):
    argv = ["cmd", *argv]
    assert shlex.split(render.node_command(argv)) == argv


def test_node_command_through_a_real_shell():
    argv = ["it's", "$(id)", "`id`", "a\nb", "", "{i}: {lines[i]}", "é"]
    out = subprocess.run(["/bin/sh", "-c", render.node_command(["printf", "%s\\0", *argv])], capture_output=True)
    assert out.stdout.split(b"\0")[:-1] == [a.encode() for a in argv]


@pytest.mark.parametrize("bad", ["ls -la", [], ["a", "b\0c"], ["a", 3]])
def test_bad_argvs_are_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        render.node_command(bad)


def run_script(argv):
    return subprocess.run(argv, capture_output=True, text=True)


def test_script_runs_steps_in_cwd_with_env_and_redirects(tmp_path):
    argv = render.script(
        ["sh", "-c", 'printf "%s|%s|%s" "$PWD" "$GREETING" "$0"', "it's $(x)"],
        ["sh", "-c", "echo err >&2"],
        cwd=str(tmp_path),
        env={"GREETING": "a 'quoted' $value"},
        stdout=str(tmp_path / "out log"),
        stderr="&1",
    )
    assert argv[:2] == ["bash", "-c"]
    assert run_script(argv).returncode == 0
    assert (tmp_path / "out log").read_text() == f"{tmp_path}|a 'quoted' $value|it's $(x)err\n"


def test_script_stops_at_first_failure(tmp_path):
    argv = render.script(["false"], ["touch", str(tmp_path / "never")])
    assert run_script(argv).returncode == 1
    assert not (tmp_path / "never").exists()


def test_script_background_detaches_and_prints_pid(tmp_path):
    log = tmp_path / "bg.log"
    argv = render.script(["sh", "-c", "echo started; echo $$ > \"$0\"", str(tmp_path / "pid")],
                         stdout=str(log), stderr="&1", append=True, background=True)
    result = run_script(argv)
    assert result.returncode == 0 and result.stdout.strip().isdigit()
    for _ in range(200):
        if log.exists() and log.read_text() == "started\n":
            break
        subprocess.run(["sleep", "0.05"])
    assert log.read_text() == "started\n"


def test_node_sequence_keeps_the_chain_status_and_always_runs_cleanup(tmp_path):
    tmp = tmp_path / "t"
    tmp.write_text("x")
    r = render.node_sequence(["sh", "-c", "exit 3"], ["true"], always=["rm", "-f", str(tmp)])
    assert subprocess.run(["/bin/sh", "-c", r.command]).returncode == 3
    assert not tmp.exists()
