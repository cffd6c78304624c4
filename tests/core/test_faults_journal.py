"""The controller's journal on its own (no Ray): what a restarted controller reads back is
exactly what was appended, a torn last record (a crash mid-append) is ignored, and a
compaction replaces everything before it."""

from __future__ import annotations

import os

from dataplane_server.core.journal import Journal

DECL = {
    "fields": ["x"],
    "expected_samples": 4,
    "consumer_tasks": ["t", "u"],
    "group_size": None,
    "task_leases": {"u": 5.0},
}


def test_replay_gives_back_declarations_cursors_and_leases(tmp_path):
    j = Journal(str(tmp_path))
    j.append("register", "p", DECL)
    j.append("register", "gone", DECL)
    j.append("claim", "p", "t", ["a", "b"], None, None)
    j.append("claim", "p", "u", ["a"], 1234.5, 7)
    j.append("claim", "p", "u", ["c"], 1234.5, 8)
    j.append("ack", "p", "u", ["c"])
    j.append("delete", "gone")
    j.close()
    state = Journal(str(tmp_path)).load()
    assert list(state) == ["p"]
    assert state["p"]["declaration"] == DECL
    tasks = state["p"]["tasks"]
    assert tasks["t"]["consumed"] == ["a", "b"]
    assert tasks["u"]["consumed"] == ["c"]
    assert tasks["u"]["leases"] == [["a", 1234.5, 7]]
    assert sorted(tasks["u"]["deliveries"]) == [["a", 1], ["c", 1]]


def test_a_torn_last_record_is_ignored_and_reset_keeps_delivery_counts(tmp_path):
    j = Journal(str(tmp_path))
    j.append("register", "p", DECL)
    j.append("claim", "p", "u", ["a"], 99.0, 1)
    j.append("reset", "p", "u")
    j.append("claim", "p", "t", ["z"], None, None)
    j.close()
    log = os.path.join(str(tmp_path), "log.0")
    with open(log, "r+b") as f:  # cut the last record in half
        f.truncate(os.path.getsize(log) - 3)
    tasks = Journal(str(tmp_path)).load()["p"]["tasks"]
    assert tasks["u"]["leases"] == []
    assert tasks["u"]["deliveries"] == [["a", 1]]
    assert tasks.get("t", {"consumed": []})["consumed"] == []


def test_compaction_replaces_the_log_and_later_records_follow_it(tmp_path):
    j = Journal(str(tmp_path), compact_every=2)
    j.append("register", "p", DECL)
    j.append("claim", "p", "t", ["a"], None, None)
    assert j.due()
    j.compact({"p": {"declaration": DECL, "tasks": {"t": {"consumed": ["a"]}}}})
    j.append("claim", "p", "t", ["b"], None, None)
    j.close()
    assert sorted(os.listdir(str(tmp_path))) == ["log.1", "snapshot.msgpack"]
    assert Journal(str(tmp_path)).load()["p"]["tasks"]["t"]["consumed"] == ["a", "b"]


def test_a_removal_forgets_what_earlier_records_said_of_its_ids_and_names_their_births(
    tmp_path,
):
    """Ids are reused: a claim of the old ``a`` must not apply to a new ``a`` put after the
    clear (issue 35), and a restart must know which copy of ``a`` the clear removed."""
    j = Journal(str(tmp_path))
    j.append("register", "p", DECL)
    j.append("claim", "p", "t", ["a", "b"], None, None)
    j.append("claim", "p", "u", ["a"], 1234.5, 7)
    j.append("filtered", "p", "t", ["c"])
    j.append("clear", "p", ["a", "c"], [5, 6])
    j.append("dropped", "p", {"t": 1}, 0, ["b"], [3])
    j.append("claim", "p", "t", ["a"], None, None)  # the new a
    j.close()
    p = Journal(str(tmp_path)).load()["p"]
    assert p["tasks"]["t"]["consumed"] == ["a"]
    assert p["tasks"]["t"]["filtered"] == []
    assert p["tasks"]["u"]["leases"] == []
    assert p["tasks"]["u"]["deliveries"] == []
    assert sorted(p["removed"]) == [["a", 5], ["b", 3], ["c", 6]]
    assert p["staleness"]["dropped"] == {"t": 1}
    assert p["staleness"]["filtered"] == {"t": 1}


def test_step_marks_and_claim_stamps_replay_through_a_compaction(tmp_path):
    """commit_step / rewind_to_step records fold as the key space applies them
    (``core/steps.py``), and a snapshot taken between them carries the marks."""
    j = Journal(str(tmp_path), compact_every=1000)
    j.append("register", "p", DECL)
    j.append("claim", "p", "t", ["a"], None, None)
    j.append("step", "p", "t", 0)
    j.append("claim", "p", "t", ["b"], None, None)
    j.append("claim", "p", "t", ["c"], None, None)
    j.append("step", "p", "t", 1)
    j.append("step", "p", "t", 1)  # the last step again: no new mark
    j.close()
    j = Journal(str(tmp_path), compact_every=1000)
    j.compact(j.load())  # the snapshot now holds what was folded
    j.append("claim", "p", "t", ["d"], None, None)
    j.append("rewind", "p", "t", 0)  # b, c, d claimed after step 0: handed back
    j.close()
    t = Journal(str(tmp_path)).load()["p"]["tasks"]["t"]
    assert t["consumed"] == ["a"]
    assert t["claimed_at"] == [["a", 1]]
    assert t["steps"] == {"claims": 4, "marks": [(0, 1)]}
