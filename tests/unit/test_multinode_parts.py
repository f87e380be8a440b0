"""Runs across hosts, the operator's small parts: the target `address`, group.json, dashboard order.
The whole flow (two netns nodes, real trainer): tests/integration/test_multinode_runs.py."""

from pathlib import Path

import pytest

from dflash_ops.errors import InventoryError
from dflash_ops.inventory import load_inventory
from dflash_ops.runs.group import check_members, check_micro_batches, group_of
from dflash_ops.runs.info import RunError, RunInfo
from dflash_ops.tui.app import group_order
from dflash_ops.tui.remote import run_row_from_info
from dflash_ops.tui.source import RunRow

INVENTORY = """\
nodes:
  pve1: {transport: ssh, address: 10.1.2.6}
targets:
  a: {node: pve1, ctid: 200, base_dir: /opt/dflash, address: %s}
"""


def test_a_target_may_name_its_address_and_a_bad_one_gets_file_and_line(tmp_path: Path):
    path = tmp_path / "hosts.yaml"
    path.write_text(INVENTORY % "10.10.0.21")
    assert load_inventory(path).target("a").address == "10.10.0.21"
    path.write_text(INVENTORY % '"10.10.0.21 10.10.0.22"')
    with pytest.raises(InventoryError, match=r"hosts.yaml:4: target 'a': address must be the container's IP"):
        load_inventory(path)


def test_a_group_needs_two_distinct_targets():
    with pytest.raises(RunError, match="at least two targets"):
        check_members(["a"])
    with pytest.raises(RunError, match="named twice"):
        check_members(["a", "b", "a"])


def test_group_json_marks_a_member():
    assert group_of(RunInfo.from_json({"run_id": "r", "group": {"targets": ["a", "b"], "index": 1}})) is not None
    assert group_of(RunInfo.from_json({"run_id": "r", "group": None})) is None


def test_the_dashboard_keeps_a_groups_rows_together_by_rank():
    def row(target, run, rank=None, world=None):
        return RunRow(target, run, "running", rank=rank, world=world)

    rows = {"a/solo": row("a", "solo"), "b/g": row("b", "g", 1, 2), "c/other": row("c", "other"),
            "a/g": row("a", "g", 0, 2)}
    assert group_order(rows) == ["a/solo", "a/g", "b/g", "c/other"]
    member = run_row_from_info("b", RunInfo.from_json({"run_id": "g", "distributed": {"rank": 1, "world_size": 2}}))
    assert (member.rank, member.world) == (1, 2)


def test_a_global_batch_that_does_not_split_over_the_hosts_is_refused_before_start():
    check_micro_batches(b"optim: {micro_batches: 4}", 2, "c.yaml")
    with pytest.raises(RunError, match=r"c.yaml: optim.micro_batches is 1, not a multiple of the 2 hosts"):
        check_micro_batches(b"model: {}", 2, "c.yaml")


def test_logs_rank_right_after_a_start_waits_for_the_ranks_to_join():
    """`logs --rank 1` in the first moments of a two-host run said "no member with rank 1": no member
    knew its rank yet. It waits for them; a rank the group cannot have, or a run that is over, is
    refused at once."""
    from dflash_ops.runs.group import Member, wait_for_rank
    from dflash_ops.runs.info import RunNotFound

    def members(*ranks, state="running"):
        return [Member(name, object(), RunInfo.from_json(  # type: ignore[arg-type]
            {"run_id": "g", "state": state, "effective_state": state,
             **({"distributed": {"rank": r, "world_size": 2}} if r is not None else {})}))
            for name, r in zip("ab", ranks)]

    looks = [members(None, None), members(None, None), members(1, 0)]
    said = []
    found = wait_for_rank(lambda: looks.pop(0), 1, poll=0.01, on_wait=said.append)
    assert found.target == "a" and not looks
    assert said == ["waiting for rank 1: the ranks are known once they joined (up to 120s)"]
    with pytest.raises(RunNotFound, match="no member with rank 2"):
        wait_for_rank(lambda: members(None, None), 2, poll=0.01)
    with pytest.raises(RunNotFound, match="no member with rank 1"):
        wait_for_rank(lambda: members(None, None, state="failed"), 1, poll=0.01)
    with pytest.raises(RunNotFound, match="no member with rank 1"):
        wait_for_rank(lambda: members(None, None), 1, timeout=0.05, poll=0.01)
