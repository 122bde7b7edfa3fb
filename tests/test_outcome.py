"""The one decision: which rank failed first, judged from facts, tested as tables of outcomes.

No process starts here. Each rank is given one of the ends a real launch produces; every
combination for 2 to 4 ranks, and seeded samples up to 8, must satisfy the rules below, whatever
order the ranks are listed in and whatever ties their clocks show.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import random
import signal

import pytest

from xlaunch.result.errors import LaunchError, LaunchTimeout, ProcessFailure, rank_ranges
from xlaunch.result.outcome import (
    NodeFacts,
    Outcome,
    RankExit,
    Unheard,
    judge,
    lost_a_peer,
    restarting,
)
from xlaunch.result.report import LaunchReport

TERM, KILL, SEGV, ABRT = signal.SIGTERM, signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT


def record(rank, when, exc_type="ValueError", message="bad batch"):
    return ProcessFailure(rank=rank, pid=100 + rank, exitcode=1, exc_type=exc_type,
                          message=message, timestamp_ns=when,
                          traceback=f"Traceback ...\n{exc_type}: {message}\n")


# Each end a rank's process can come to, as (kind, maker). ``when`` is the rank's own clock.
ENDS = {
    "raised": lambda r, when: RankExit(r, 100 + r, 1, record(r, when)),
    "raised-other": lambda r, when: RankExit(r, 100 + r, 1, record(r, when, "KeyError", "'x'")),
    "lost-peer": lambda r, when: RankExit(r, 100 + r, 1, record(
        r, when, "RuntimeError", "[pair.cc:537] Read error: Connection reset by peer")),
    "killed-itself": lambda r, when: RankExit(r, 100 + r, -KILL),
    "segfault-after-term": lambda r, when: RankExit(r, 100 + r, -SEGV, signals_sent=frozenset({TERM})),
    "exit-3": lambda r, when: RankExit(r, 100 + r, 3),
    "stopped": lambda r, when: RankExit(r, 100 + r, -TERM, signals_sent=frozenset({TERM})),
    "stopped-hard": lambda r, when: RankExit(r, 100 + r, -KILL, signals_sent=frozenset({TERM, KILL})),
    "cancelled": lambda r, when: RankExit(r, 100 + r, 0, cancelled=True),  # found it stopped
    "exit-75": lambda r, when: RankExit(r, 100 + r, 75),  # os._exit(75): the user's, like any
    # torch_xla's pool processes: their status goes to the pool, not to the launch's owner.
    "engine-died": lambda r, when: RankExit(r, 100 + r, None),
    "engine-terminated": lambda r, when: RankExit(r, 100 + r, None, terminated=True),
    # Its own SIGTERM handler saved a checkpoint and exited 0 when the launcher stopped it.
    "handled-term": lambda r, when: RankExit(r, 100 + r, 0, signals_sent=frozenset({TERM})),
    "finished": lambda r, when: RankExit(r, 100 + r, 0, returned=True),
    "exited-0-early": lambda r, when: RankExit(r, 100 + r, 0),  # os._exit(0) in the function
    "returned-then-killed": lambda r, when: RankExit(r, 100 + r, -KILL, returned=True,
                                                     signals_sent=frozenset({KILL})),
}
# The function returned (no failure, whatever came after), or the rank never ran.
DONE = {"finished", "returned-then-killed", "cancelled"}
DIED = {"killed-itself", "segfault-after-term", "exit-3", "exited-0-early", "exit-75",
        "engine-died"}
RAISED = {"raised", "raised-other"}
SECONDARY = {"lost-peer", "stopped", "stopped-hard", "handled-term", "engine-terminated"}
# At a timeout, a rank whose function returned but whose process the owner found alive and
# stopped was held by its own threads: the reason the launch did not end.
HELD = {"returned-then-killed"}


def finished_early(kinds, timed_out=False):
    """Ranks whose function returned while a peer lost a peer and nothing failed on its own."""
    if "lost-peer" not in kinds or any(kind in DIED | RAISED for kind in kinds) or held(
            kinds, timed_out):
        return []
    return [r for r, kind in enumerate(kinds) if kind in DONE - {"cancelled"}]


def held(kinds, timed_out):
    return [r for r, kind in enumerate(kinds) if timed_out and kind in HELD]


def expected_root(kinds, whens, timed_out=False):
    """The rules, written out: a death nobody sent, then the earliest raise, then a rank that
    finished while its peers waited on it, then one held by its own threads at a timeout, then
    a lost peer."""
    died = [r for r, kind in enumerate(kinds) if kind in DIED]
    if died:
        return min(died)
    early = finished_early(kinds, timed_out)
    raised = [r for r, kind in enumerate(kinds) if kind in RAISED]
    if raised:
        return min(raised, key=lambda r: (whens[r], r))
    if early:
        return min(early)
    if held(kinds, timed_out):
        return min(held(kinds, timed_out))
    lost = [r for r, kind in enumerate(kinds) if kind == "lost-peer"]
    return min(lost, key=lambda r: (whens[r], r)) if lost else None


def check(kinds, whens, shuffle_seed=0, timed_out=False):
    exits = [ENDS[kind](rank, when) for rank, (kind, when) in enumerate(zip(kinds, whens, strict=True))]
    random.Random(shuffle_seed).shuffle(exits)  # the order ranks are listed in must not matter
    error = judge(Outcome("elastic", len(kinds), tuple(exits), timed_out=timed_out, timeout=5))
    failed = sorted([r for r, kind in enumerate(kinds) if kind not in DONE]
                    + finished_early(kinds, timed_out) + held(kinds, timed_out))
    if timed_out:
        assert isinstance(error, LaunchTimeout)
    elif not failed:
        assert error is None
        return
    assert error is not None
    assert sorted(f.rank for f in error.failures) == failed  # every failed rank, once
    root = expected_root(kinds, whens, timed_out)
    assert (error.root_cause.rank if error.root_cause else None) == root, (kinds, whens)
    for failure in error.failures:
        expected = kinds[failure.rank] in SECONDARY or (
            timed_out and kinds[failure.rank] not in DIED | RAISED | HELD | DONE)
        assert failure.secondary == expected, (kinds, failure)
    if root is not None:
        assert str(error).splitlines()[2].startswith("[root cause] rank")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_combination_of_ends(size):
    for kinds in itertools.product(ENDS, repeat=size):
        for whens in ((100,) * size, tuple(range(size * 10, 0, -10))):  # all tied; reversed
            check(kinds, whens, shuffle_seed=size)


@pytest.mark.parametrize("size", [5, 6, 7, 8])
def test_seeded_samples_up_to_eight_ranks(size):
    rng = random.Random(size)
    for sample in range(400):
        kinds = [rng.choice(list(ENDS)) for _ in range(size)]
        whens = [rng.choice((100, 200, 300)) for _ in range(size)]  # ties on purpose
        check(kinds, whens, shuffle_seed=sample, timed_out=sample % 7 == 0)


def test_a_killed_rank_outranks_the_peer_whose_connection_it_broke():
    error = judge(Outcome("elastic", 2, (
        ENDS["lost-peer"](0, 50), ENDS["killed-itself"](1, 0))))
    assert error.root_cause.rank == 1 and error.root_cause.exitcode == -KILL
    assert "without raising a Python exception" in str(error)
    assert error.failures[1].cause == "lost-peer" and error.failures[1].secondary


def test_a_rank_stopped_by_the_launcher_is_never_the_cause():
    error = judge(Outcome("elastic", 2, (ENDS["stopped"](0, 0), ENDS["raised"](1, 900))))
    assert error.root_cause.rank == 1
    assert "[secondary: stopped by the launcher] rank 0" in str(error)


def test_only_stopped_ranks_have_no_root_cause():
    error = judge(Outcome("elastic", 2, (ENDS["stopped"](0, 0), ENDS["cancelled"](1, 0))))
    assert error.root_cause is None and error.exitcode == 1


def test_eight_cores_hitting_one_bug_are_one_entry_with_one_traceback():
    exits = tuple(ENDS["raised"](rank, 100 + rank) for rank in range(8))
    text = str(judge(Outcome("xla", 8, exits)))
    assert "[root cause] ranks 0-7: ValueError: bad batch" in text
    assert text.count("Traceback") == 1


def test_two_different_errors_are_both_failures_in_their_own_right():
    error = judge(Outcome("elastic", 3, (
        ENDS["raised"](0, 200), ENDS["raised-other"](2, 100), ENDS["stopped"](1, 0))))
    assert [f.rank for f in error.failures] == [2, 0, 1]
    assert [f.secondary for f in error.failures] == [False, False, True]
    text = str(error)
    assert "[root cause] rank 2 (pid 102): KeyError" in text
    assert "[failed] rank 0 (pid 100): ValueError: bad batch" in text
    headings = [line for line in text.splitlines() if line.startswith("[")]
    assert [heading.split(":")[0] for heading in headings] == [
        "[root cause] rank 2 (pid 102)", "[failed] rank 0 (pid 100)", "[secondary"]
    assert headings[2].startswith("[secondary: stopped by the launcher] rank 1")


def test_a_timeout_lists_every_rank_with_where_it_stood():
    exits = (RankExit(1, 8, None, signals_sent=frozenset({KILL}), stack='  File "t.py", line 9'),
             RankExit(0, 7, None, signals_sent=frozenset({KILL}), stack='  File "t.py", line 4'))
    error = judge(Outcome("elastic", 2, exits, timed_out=True, timeout=3))
    text = str(error)
    assert isinstance(error, LaunchTimeout) and "timeout=3 s" in text
    assert text.index("[stopped at the timeout] rank 0 (pid 7)") < text.index("rank 1 (pid 8)")
    assert "line 9" in text and error.root_cause is None


def test_a_timeout_before_any_worker_started():
    error = judge(Outcome("elastic", 2, (), timed_out=True, timeout=3))
    assert isinstance(error, LaunchTimeout) and "no worker had started" in str(error)


def test_a_leader_failure_is_the_root_cause():
    leader = ProcessFailure(rank=0, pid=5, exc_type="ModuleNotFoundError",
                            message="No module named 'torch_xla'")
    error = judge(Outcome("xla", 8, (), leader_failure=leader))
    assert error.root_cause.cause == "leader" and "before any worker ran" in str(error)


def test_earlier_attempts_are_kept_and_shown():
    first = (ENDS["raised"](0, 1), ENDS["stopped"](1, 0))
    error = judge(Outcome("elastic", 2, (ENDS["killed-itself"](1, 0), ENDS["stopped"](0, 0)),
                          earlier_attempts=(first,)))
    assert error.earlier_attempts[0][0].rank == 0
    assert "attempt 1 (restarted) failed first with rank 0 (pid 100): ValueError" in str(error)


def test_errors_pickle_with_their_failures():
    error = judge(Outcome("elastic", 2, (ENDS["raised"](1, 5), ENDS["stopped"](0, 0))))
    copy = pickle.loads(pickle.dumps(error))
    assert copy.failures == error.failures and str(copy) == str(error)
    assert isinstance(copy, LaunchError)


def test_the_record_file_format_round_trips_and_tolerates_other_versions():
    failure = record(3, 42)
    assert ProcessFailure.from_json(failure.to_json()) == failure
    newer = failure.to_json()[:-1] + ', "field_from_the_future": 1}'
    assert ProcessFailure.from_json(newer, error_file="f.json").error_file == "f.json"


def test_rank_ranges():
    assert rank_ranges([5]) == "rank 5"
    assert rank_ranges([3, 0, 1, 2, 5, 7, 6]) == "ranks 0-3, 5-7"


def test_a_rank_that_returned_while_its_peers_waited_is_the_root_cause():
    waited = RankExit(0, 100, 1, dataclasses.replace(
        record(0, 5, "RuntimeError", "Connection closed by peer"),
        traceback='  File "nb.py", line 7, in train\n    wait_for_everyone()\nRuntimeError: closed\n'))
    error = judge(Outcome("elastic", 2, (waited, RankExit(1, 101, 0, returned=True))))
    assert error.root_cause.rank == 1 and error.root_cause.cause == "finished-early"
    text = str(error)
    assert "rank 1 finished (its function returned) while its peers still waited on it" in text
    assert "rank 0 was waiting here" in text and "wait_for_everyone()" in text
    assert error.exitcode == 1


def test_a_finished_rank_on_a_node_of_several_is_not_blamed_for_a_remote_peer():
    lost = ENDS["lost-peer"](0, 5)
    error = judge(Outcome("elastic", 4, (lost, RankExit(1, 101, 0, returned=True))))
    assert [f.rank for f in error.failures] == [0] and error.root_cause.cause == "lost-peer"


def test_an_exit_with_status_zero_before_the_function_returned_is_a_failure():
    error = judge(Outcome("xla", 1, (RankExit(0, 100, 0),)))
    assert error is not None and error.root_cause.rank == 0
    assert "os._exit(0)" in str(error)


def test_the_exit_status_a_rank_recorded_is_the_launchs():
    meant = dataclasses.replace(record(0, 1, "SystemExit", "21"), exitcode=21)
    error = judge(Outcome("xla", 1, (RankExit(0, 100, -KILL, meant, frozenset({KILL})),)))
    assert error.exitcode == 21


def test_a_rank_killed_after_its_function_returned_is_the_cause_of_its_peers_stop():
    """Rank 0 returned (its value whole), then the out-of-memory killer ended its process while
    rank 1 still ran; the owner stopped rank 1 for it. Before, the error named only rank 1."""
    gone = RankExit(0, 100, -KILL, returned=True)
    error = judge(Outcome("elastic", 2, (gone, ENDS["stopped"](1, 0))))
    assert error is not None and error.root_cause.rank == 0, error
    assert error.root_cause.exitcode == -KILL and not error.root_cause.secondary
    assert "its function returned, then its process" in str(error), str(error)
    assert judge(Outcome("elastic", 2, (gone, ENDS["finished"](1, 0)))) is None  # all done


# --- several machines: what another node told this one (issue 33, point 5) -----------------------

def told(rank, node, kind="raised", when=50):
    """Another node's failure as it arrives through the store: judged there, marked with it."""
    failure = judge(Outcome("elastic", 4, (ENDS[kind](rank, when),))).failures[0]
    return dataclasses.replace(failure, node=node, host=f"h{node + 1}", told=True).to_share()


@pytest.mark.parametrize("elsewhere", ["raised", "killed-itself", "lost-peer", None])
def test_every_pair_of_ends_here_with_what_another_node_told(elsewhere):
    """Node 0 holds ranks 0-1; node 1 told that its rank 3 failed (or told nothing). This
    node's own failure leads when it has one: it failed before it heard (else it would have
    been stopped), where two machines' clocks cannot be compared. Otherwise the other node's."""
    there = () if elsewhere is None else (told(3, 1, elsewhere),)
    for kinds in itertools.product(ENDS, repeat=2):
        exits = tuple(ENDS[kind](rank, 100) for rank, kind in enumerate(kinds))
        error = judge(Outcome("elastic", 4, exits, nodes=NodeFacts(0, "h1", there)))
        own = [r for r, kind in enumerate(kinds) if kind in DIED | RAISED]
        remote = elsewhere in ("raised", "killed-itself")
        if error is None:  # its ranks all finished: what another node said changes nothing
            assert all(kind in DONE for kind in kinds), kinds
            continue
        root = error.root_cause
        if own:
            assert (root.node, root.rank) == (0, expected_root(kinds, (100, 100))), kinds
        elif remote:
            assert (root.node, root.rank, root.host) == (1, 3, "h2"), kinds
            assert str(error).startswith("the launch failed: rank 3 on node 1 (host h2) "), kinds
        assert all(f.node is not None for f in error.failures), kinds
        assert len([f for f in error.failures if f.node == 1]) == (1 if remote else 0), kinds


def test_the_healthy_hosts_error_leads_with_the_remote_rank_and_its_traceback():
    """The issue's case: host 1's ranks were stopped because rank 3 on host 2 raised. Before,
    its whole error was "rank 0 killed by SIGTERM ... [secondary] ranks 0-1"."""
    stopped = (ENDS["stopped"](0, 0), ENDS["stopped"](1, 0))
    report = LaunchReport("elastic", 1.0)
    error = judge(Outcome("elastic", 4, stopped, nodes=NodeFacts(0, "h1", (told(3, 1),))), report)
    text = str(error)
    assert text.startswith("the launch failed: rank 3 on node 1 (host h2) raised ValueError; "
                           "2 other ranks of 4 failed"), text
    lines = text.splitlines()
    assert lines[2] == "[root cause] rank 3 (pid 103) on node 1 (host h2): ValueError: bad batch"
    assert "told by node 1's launch through the rendezvous store" in lines[3]
    assert "Traceback ..." in text
    assert "[secondary: stopped by the launcher] ranks 0-1 on node 0 (host h1): killed by " \
           "SIGTERM" in text
    assert error.report.root_cause == "rank 3 on node 1 (host h2) raised ValueError: bad batch"
    assert "root cause: rank 3 on node 1 (host h2)" in str(error.report)
    assert "root cause" in error.report._repr_html_()


def test_a_node_that_failed_on_its_own_leads_with_its_own_and_lists_the_others():
    here = (ENDS["raised"](0, 900), ENDS["stopped"](1, 0))
    error = judge(Outcome("elastic", 4, here, nodes=NodeFacts(0, "h1", (told(3, 1, when=1),))))
    assert (error.root_cause.node, error.root_cause.rank) == (0, 0)
    assert [(f.node, f.rank, f.secondary) for f in error.failures] == [
        (0, 0, False), (1, 3, False), (0, 1, True)]


def test_nodes_not_heard_from_are_named_with_their_ranks():
    stopped = (ENDS["stopped"](0, 0), ENDS["stopped"](1, 0))
    quiet = Unheard(1, "h2", (2, 3), 15.0)
    error = judge(Outcome("elastic", 4, stopped, nodes=NodeFacts(0, "h1", unheard=(quiet,))))
    assert str(error).startswith("the launch failed: ranks 2-3 on node 1 (host h2) gave no sign "
                                 "of life through the rendezvous store; 2 other ranks of 4"), error
    assert "[root cause] ranks 2-3 on node 1 (host h2)" in str(error)
    assert "for 15 s, and it never said it ended" in str(error)
    cut = Unheard(0, "h1", (0, 1), 15.0, store="10.0.0.1:29500")
    error = judge(Outcome("elastic", 4, stopped, nodes=NodeFacts(1, "h2", unheard=(cut,))))
    assert "the rendezvous store at 10.0.0.1:29500 stopped answering this machine" in str(error)


def test_at_a_timeout_what_another_node_told_does_not_lead():
    timed = (RankExit(0, 100, -TERM, signals_sent=frozenset({TERM}), running_at_deadline=True),)
    error = judge(Outcome("elastic", 2, timed, timed_out=True, timeout=5,
                          nodes=NodeFacts(0, "h1", (told(1, 1),))))
    assert isinstance(error, LaunchTimeout) and [f.node for f in error.failures] == [0]


def test_a_restart_names_the_failure_wherever_it_was():
    stopped = (ENDS["stopped"](0, 0), ENDS["stopped"](1, 0))
    error = judge(Outcome("elastic", 4, stopped, nodes=NodeFacts(0, "h1", (told(3, 1),))))
    assert restarting(error, 2, 3) == ("restarting (attempt 2 of 3) after rank 3 on node 1 "
                                       "(host h2) raised ValueError: bad batch")
    died = judge(Outcome("elastic", 2, (ENDS["killed-itself"](1, 0),)))
    assert restarting(died, 2, 2) == ("restarting (attempt 2 of 2) after rank 1 ended without "
                                      "an exception (killed by SIGKILL)")


def test_earlier_attempts_keep_what_other_nodes_told():
    stopped = (ENDS["stopped"](0, 0), ENDS["stopped"](1, 0))
    error = judge(Outcome("elastic", 4, (ENDS["raised"](0, 1), ENDS["stopped"](1, 0)),
                          nodes=NodeFacts(1, "h2"), earlier_attempts=(stopped,),
                          earlier_nodes=(NodeFacts(0, "h1", (told(3, 1),)),)))
    assert "attempt 1 (restarted) failed first with rank 3 (pid 103) on node 1 (host h2): " \
           "ValueError: bad batch" in str(error), str(error)


def test_what_a_node_tells_the_others_is_bounded_and_plain():
    long = dataclasses.replace(record(3, 7), message="m" * 10_000,
                               traceback="".join(f"  line {n}\n" for n in range(5000)),
                               stack="where it stood", error_file="/tmp/x/failure-3.json",
                               full_text="/tmp/x/failure-3.txt", stderr_tail="e\n" * 5000)
    shared = dataclasses.replace(long, node=1, host="h2").to_share()
    assert len(shared.to_json()) < 16_000
    assert shared.traceback.endswith("  line 4999\n") and shared.message.startswith("mmm")
    assert (shared.stack, shared.error_file, shared.full_text) == ("", None, None)
    back = ProcessFailure.from_json(shared.to_json())
    assert back == shared and (back.node, back.host) == (1, "h2")


def test_gloo_says_a_peer_went_away_in_words_and_a_mismatch_is_the_ranks_own():
    """gloo's own texts (torch 2.13): a peer gone is in its words; two ranks all-reducing tensors
    of different sizes fail in the same transport file (the rank that received too much: a
    gloo::EnforceNotMet), and that is their own error."""
    gone = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [10.77.0.3]:6350. This is typically caused by a remote worker "
            "crashing. Check the logs of the remote worker before reporting an error.")
    reset = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
             "[127.0.0.1]:29368: Connection reset by peer.")
    assert lost_a_peer(record(1, 5, "RuntimeError", gone))
    assert lost_a_peer(record(1, 5, "RuntimeError", reset))
    mismatch = ("[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                "pair.cc:456] op.preamble.length <= op.nbytes. 100000 vs 4. Received data size "
                "doesn't match expected size. Is there a distributed collective mismatch in your "
                "code?")
    assert not lost_a_peer(record(1, 5, "RuntimeError", mismatch))
