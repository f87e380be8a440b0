"""Services (a serving engine) in a container, on the simulated node and through a real sshd,
and the serve / stop-serve steps (stopped also when a later step fails)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_ops.playbook.play import PlaybookError, load_playbook, run_playbook
from dflash_ops.services import ServiceError, start_service, stop_service, wait_service
from dflash_ops.simnode import containers as simct
from tests.conftest import free_port, write_sim_inventory
from tests.containers import ContainerProcs, process_inside, sim_root
from tests.integration.deploy_support import sim_container, sshd_container

pytestmark = pytest.mark.lxc_tier


@pytest.fixture(params=["sim", pytest.param("sshd", marks=pytest.mark.sshd)])
def container(request, tmp_path):
    if request.param == "sim":
        yield sim_container(tmp_path)
        return
    box = sshd_container(request.getfixturevalue("sshd_node"))
    yield box
    box.transport.close()


@pytest.fixture
def procs(request, container) -> ContainerProcs:
    """The container's processes by the pids it sees (a real LXC container's are not this machine's)."""
    on_sshd = request.node.callspec.params.get("container") == "sshd"
    root = request.getfixturevalue("sshd_node").sim_root if on_sshd else sim_root(container)
    return ContainerProcs(root, container.target.ctid)


def server(python: str, port: int) -> list[str]:
    """A web server that spawns a child, run by `python` (the container's own)."""
    return [python, "-c", "import http.server, sys, subprocess; subprocess.Popen(['sleep', '300']); "
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()",
            str(port)]


def test_start_wait_stop_stops_the_whole_session_and_nothing_else(container, procs):
    port = free_port()
    cwd = Path(container.base_dir).parent  # in the container's test directory (tmp_path is not in an LXC container)
    cwd.mkdir(parents=True, exist_ok=True)
    with process_inside(container) as bystander:
        record = start_service(container, "web", server(container.target.python, port), cwd=str(cwd))
        wait_service(container, "web", f"http://127.0.0.1:{port}/", timeout=120, poll=0.1)
        members = procs.session_members(record["pid"])
        assert len(members) == 2, "the server and the child it spawned"
        with pytest.raises(ServiceError, match="already running"):
            start_service(container, "web", server(container.target.python, port))
        done = stop_service(container, "web", grace=10)
        assert sorted(done["signalled"]) == sorted(members)
        assert not any(procs.alive(pid) for pid in members)
        assert procs.alive(bystander), "a process the service did not start is never signalled"
        assert stop_service(container, "web")["signalled"] == [], "stopping a stopped service is fine"
        log = Path(container.base_dir) / "services" / "web" / "service.log"
        assert "# dflash-ops service start" in log.read_text()


def test_a_service_that_dies_is_reported_with_its_log(container):
    start_service(container, "bad", [container.target.python, "-c", "import sys; print('no model at /models/x'); sys.exit(3)"])
    with pytest.raises(ServiceError, match="exited before .* answered; the end of its log:\n  no model at /models/x"):
        wait_service(container, "bad", f"http://127.0.0.1:{free_port()}/", timeout=120, poll=0.1)
    with pytest.raises(ServiceError, match="cannot start no-such-program"):
        start_service(container, "bad2", ["no-such-program"])
    with pytest.raises(ServiceError, match="bad service name"):
        start_service(container, "../x", ["true"])


def test_a_service_that_never_answers_times_out_with_its_log(container, procs):
    never = [container.target.python, "-c", "import time; print('loading shards', flush=True); time.sleep(300)"]
    record = start_service(container, "slow", never)
    with pytest.raises(ServiceError, match=r"did not answer http://127.0.0.1:\d+/v1/models within 1s "
                                           r".*; the end of its log:\n  loading shards"):
        wait_service(container, "slow", f"http://127.0.0.1:{free_port()}/v1/models", timeout=1, poll=0.1)
    assert procs.alive(record["pid"]), "wait only reports; the serve step's cleanup stops it"
    stop_service(container, "slow", grace=5)
    assert not procs.alive(record["pid"])


def test_an_answer_from_a_server_the_service_did_not_start_is_not_readiness(container, procs):
    """The service's own pid lives, but the port is answered by a process outside its session (here
    one it detached; a server already there that bound first): "something answered" is not "my
    process is ready"."""
    port = free_port()
    stranger = ("import http.server, sys, threading, time; s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), "
                "http.server.SimpleHTTPRequestHandler); threading.Thread(target=s.serve_forever, daemon=True).start(); "
                "time.sleep(30)")
    detaches = [container.target.python, "-c",
                "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
                "start_new_session=True); time.sleep(300)", stranger, str(port)]
    record = start_service(container, "detached", detaches, port=port)
    try:
        with pytest.raises(ServiceError, match=rf"127\.0\.0\.1:{port} is answered by pid \d+, not by service "
                                               rf"detached \(pid {record['pid']}\)"):
            wait_service(container, "detached", f"http://127.0.0.1:{port}/", timeout=120, poll=0.1)
    finally:
        stop_service(container, "detached", grace=5)


def test_stop_never_signals_a_pid_that_is_no_longer_the_service(container, procs):
    """The recorded pid now belongs to another process (its start time differs): leave it alone."""
    with process_inside(container) as stranger:  # a session leader, like a service
        record = start_service(container, "gone", [container.target.python, "-c", "pass"])
        path = Path(container.base_dir) / "services" / "gone" / "service.json"
        path.write_text(json.dumps({**record, "pid": stranger, "pid_start": procs.start_ticks(stranger) - 1}))
        assert stop_service(container, "gone", grace=1)["signalled"] == []
        assert procs.alive(stranger)


def write_playbook(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_serve_step_stops_the_engine_when_a_later_step_fails(container, procs, tmp_path):
    port = free_port()
    argv = json.dumps(server(container.target.python, port))
    book = write_playbook(tmp_path / "serve.yaml", f"""
steps:
  - serve: {{name: web, argv: {argv}, port: {port}, health: /}}
  - exec: [sh, -c, "echo using ${{endpoint}}; exit 7"]
""")
    lines: list[str] = []
    result = run_playbook(load_playbook(book), container, say=lines.append)
    assert "step 2 (exec) failed" in result.error and "status 7" in result.error
    assert f"using http://127.0.0.1:{port}" in lines
    assert "[cleanup] stop service web" in lines
    record = json.loads((Path(container.base_dir) / "services" / "web" / "service.json").read_text())
    assert record["state"] == "stopped" and not procs.alive(record["pid"])


def test_stop_serve_step_stops_it_once(tmp_path):
    container = sim_container(tmp_path)
    port = free_port()
    argv = json.dumps(server(container.target.python, port))
    book = write_playbook(tmp_path / "serve.yaml", f"""
steps:
  - serve: {{name: web, argv: {argv}, port: {port}, health: /}}
  - stop-serve: web
  - echo: done
""")
    lines: list[str] = []
    result = run_playbook(load_playbook(book), container, say=lines.append)
    assert result.ok, result.error
    assert not any(line.startswith("[cleanup]") for line in lines)
    assert sum("service web stopped" in line for line in lines) == 1


def test_var_values_use_builtins_and_earlier_vars(tmp_path):
    container = sim_container(tmp_path)
    book = write_playbook(tmp_path / "vars.yaml", """
vars:
  data: ${base_dir}/data
  model: ${data}/models/m
steps:
  - echo: "${model}"
""")
    lines: list[str] = []
    assert run_playbook(load_playbook(book), container, say=lines.append).ok
    assert f"{container.base_dir}/data/models/m" in lines
    bad = write_playbook(tmp_path / "bad.yaml", "vars:\n  a: ${b}\n  b: x\nsteps:\n  - echo: hi\n")
    with pytest.raises(PlaybookError, match=r"bad.yaml:2: undefined variable 'b'"):
        load_playbook(bad)


def test_push_fetch_and_local_steps(tmp_path):
    container = sim_container(tmp_path)
    data = Path(container.base_dir).parent / "data"
    book = write_playbook(tmp_path / "io.yaml", f"""
vars:
  dest: {data}/made
steps:
  - local: [python, -c, "import pathlib; pathlib.Path('made').mkdir(); pathlib.Path('made/x.txt').write_text('x')"]
  - push: {{src: made, dest: "${{dest}}"}}
  - exec: [sh, -c, "echo y > ${{dest}}/y.txt"]
  - fetch: {{src: "${{dest}}", dest: back, force: true}}
""")
    lines: list[str] = []
    result = run_playbook(load_playbook(book), container, say=lines.append)
    assert result.ok, result.error
    assert (data / "made" / "x.txt").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["x.txt", "y.txt"]


def test_serve_refuses_a_port_another_server_already_answers(tmp_path):
    """Else the wait would take the other server's answers for the engine's."""
    container = sim_container(tmp_path)
    said = tmp_path / "simnode" / "ct200" / "other.port"  # the container's test directory
    said.parent.mkdir(parents=True, exist_ok=True)
    listen = ("import os, socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
              "open(sys.argv[1] + '.tmp', 'w').write(str(s.getsockname()[1])); os.rename(sys.argv[1] + '.tmp', sys.argv[1]); "
              "time.sleep(300)")
    with process_inside(container, [container.target.python, "-c", listen, str(said)]):  # the other server
        for _ in range(1200):
            if said.exists():
                break
            time.sleep(0.05)
        port = int(said.read_text())
        book = write_playbook(tmp_path / "serve.yaml", f"""
steps:
  - serve: {{name: web, argv: {json.dumps(server(container.target.python, port))}, port: {port}, health: /}}
""")
        result = run_playbook(load_playbook(book), container, say=lambda line: None)
    assert "step 1 (serve) failed: something already listens on 127.0.0.1:" in result.error
    assert not (Path(container.base_dir) / "services" / "web" / "service.json").exists()


def test_ctrl_c_during_a_playbook_stops_the_engine(tmp_path):
    inventory = write_sim_inventory(tmp_path / "simnode")
    base = tmp_path / "simnode" / "ct200" / "opt" / "dflash"
    procs = ContainerProcs(tmp_path / "simnode" / "sim", 200)
    port = free_port()
    python = simct.container_python(procs.root, 200)
    book = write_playbook(tmp_path / "serve.yaml", f"""
steps:
  - serve: {{name: web, argv: {json.dumps(server(python, port))}, port: {port}, health: /}}
  - sleep: 300
""")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops", "play", str(book), "host200", "--inventory",
                             str(inventory)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # as from a terminal: a suite started in the background has SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if "[2/2] sleep" in line:
                break
        record = json.loads((base / "services" / "web" / "service.json").read_text())
        assert procs.alive(record["pid"])
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "[cleanup] stop service web" in rest
    record = json.loads((base / "services" / "web" / "service.json").read_text())
    assert record["state"] == "stopped" and not procs.alive(record["pid"])


@pytest.fixture
def hold_step():
    """A step type `hold` that registers a cleanup, then: on host201 (played in the main thread)
    raises KeyboardInterrupt once host200 (played in a worker thread) holds; on host200 waits."""
    from dflash_ops.playbook.registry import STEP_TYPES, StepType, register_step

    held, cleaned = threading.Event(), []

    def hold(ctx, params):
        ctx.cleanups.append((f"release {ctx.target}", lambda: cleaned.append(ctx.target)))
        if ctx.target == "host201":
            assert held.wait(60)
            raise KeyboardInterrupt
        held.set()
        threading.Event().wait(60)

    register_step(StepType("hold", hold, help="test only"))
    yield cleaned
    del STEP_TYPES["hold"]


def test_ctrl_c_runs_the_cleanups_of_every_target(tmp_path, hold_step):
    """With several targets only the main thread's target unwinds by itself; play runs the rest."""
    from typer.testing import CliRunner

    from dflash_ops.cli import app

    inventory = write_sim_inventory(tmp_path / "simnode", ctids=(200, 201))
    book = write_playbook(tmp_path / "hold.yaml", "steps:\n  - hold: {}\n")
    result = CliRunner().invoke(app, ["play", str(book), "host200", "host201", "--inventory", str(inventory)])
    assert result.exit_code != 0
    assert sorted(hold_step) == ["host200", "host201"]
    assert "host200: [cleanup] release host200" in result.output
