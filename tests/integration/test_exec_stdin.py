"""`dflash-ops exec` forwards stdin byte for byte, on the simulated node and through a real sshd.

The CLI runs as a real process (its stdin a real pipe or file), as a user runs it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.inventory import load_inventory
from tests.conftest import write_sim_inventory

pytestmark = pytest.mark.lxc_tier

HANG_GUARD_S = 120  # only catches a hang; never a speed bound


@pytest.fixture(params=["sim", pytest.param("sshd", marks=pytest.mark.sshd)])
def inventory(request, tmp_path) -> Path:
    if request.param == "sim":
        return write_sim_inventory(tmp_path / "simnode")
    return request.getfixturevalue("sshd_node").inventory


def _exec(inventory: Path, *argv: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_OPS_INVENTORY=str(inventory))
    return subprocess.run([sys.executable, "-m", "dflash_ops", "exec", "host200", "--", *argv],
                          env=env, capture_output=True, timeout=HANG_GUARD_S, **kwargs)


def test_piped_stdin_reaches_the_command(inventory, tmp_path):
    # beside base_dir: a path this machine and the container both see (an LXC container of the
    # test tiers has its test directory bound at the same path)
    out = Path(load_inventory(inventory).target("host200").base_dir).parent / f"f-{tmp_path.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = _exec(inventory, "tee", str(out), input=b"important\n")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == b"important\n"
    assert result.stdout == b"important\n"


def test_50_mb_through_sha256sum(inventory, tmp_path):
    data = os.urandom(1 << 20) * 50
    source = tmp_path / "big"
    source.write_bytes(data)
    with open(source, "rb") as stdin:
        result = _exec(inventory, "sha256sum", stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


def test_binary_stdin_and_eof_closes_the_remote_stdin(inventory):
    data = bytes(range(256)) * 64 + b"\0\r\n\xff no newline"
    result = _exec(inventory, "cat", input=data)  # cat ends only when its stdin reaches EOF
    assert result.returncode == 0 and result.stdout == data


def test_a_command_that_ignores_stdin_ends_although_stdin_stays_open(inventory):
    env = dict(os.environ, DFLASH_OPS_INVENTORY=str(inventory))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops", "exec", "host200", "--", "echo", "quick"],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)  # stdin is still open while it waits
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out == b"quick\n"


def test_no_stdin_flag_gives_the_command_eof(inventory):
    env = dict(os.environ, DFLASH_OPS_INVENTORY=str(inventory))
    result = subprocess.run([sys.executable, "-m", "dflash_ops", "exec", "-n", "host200", "--", "cat"],
                            env=env, input=b"not for cat", capture_output=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0 and result.stdout == b""


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e300"])
def test_timeout_that_is_not_a_finite_positive_number_is_one_line(tmp_path, value):
    env = dict(os.environ, DFLASH_OPS_INVENTORY=str(write_sim_inventory(tmp_path / "simnode")))
    result = subprocess.run([sys.executable, "-m", "dflash_ops", "exec", "--timeout", value, "host200", "--", "true"],
                            env=env, capture_output=True, timeout=HANG_GUARD_S, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--timeout" in result.stderr and "Traceback" not in result.stderr


def test_argv_over_the_kernel_limit_is_refused_before_sending(inventory, tmp_path):
    marker = tmp_path / "ran"
    result = _exec(inventory, "sh", "-c", 'touch "$0"', str(marker), "a" * 70000, "b" * 70000)
    assert result.returncode == 1 and not marker.exists()
    err = result.stderr.decode()
    assert err.count("\n") == 1 and "MAX_ARG_STRLEN" in err and "nothing was sent" in err


def test_argv_just_under_the_limit_still_runs(inventory):
    big = "x" * 130000
    result = _exec(inventory, "python3", "-c", "import sys; print(len(sys.argv[1]))", big)
    assert result.returncode == 0 and result.stdout == b"130000\n"


def test_nul_in_an_argument_is_one_clean_error():
    from dflash_ops import render

    with pytest.raises(render.ArgNotSendable, match="NUL"):
        render.pct_exec(["pct"], 200, ["echo", "a\0b"])
