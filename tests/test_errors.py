"""The one formatter: root cause first, secondary failures after it, each said once."""

from xlaunch.errors import LaunchError, LaunchTimeout, ProcessFailure, order_failures


def test_the_earliest_failure_is_the_root_cause_whatever_its_rank():
    peer = ProcessFailure(rank=0, exc_type="RuntimeError", message="Connection closed by peer",
                          traceback="Traceback ...\nRuntimeError: Connection closed by peer\n",
                          timestamp_ns=200)
    raiser = ProcessFailure(rank=1, exc_type="ValueError", message="bad batch",
                            traceback="Traceback ...\nValueError: bad batch\n", timestamp_ns=100)
    ordered = order_failures([peer, raiser])
    assert [f.rank for f in ordered] == [1, 0] and [f.secondary for f in ordered] == [False, True]


def test_a_silent_death_before_a_peers_error_leads_and_ties_prefer_a_known_exit():
    death = ProcessFailure(rank=2, exitcode=-9, timestamp_ns=50, message="ended without raising")
    stopped = ProcessFailure(rank=0, timestamp_ns=50, message="ended without raising")
    peer = ProcessFailure(rank=1, exc_type="RuntimeError", message="closed by peer", timestamp_ns=60)
    assert [f.rank for f in order_failures([stopped, peer, death])] == [2, 0, 1]


def test_the_message_leads_with_the_root_cause_and_says_a_secondary_once():
    error = LaunchError("the launch failed", [
        ProcessFailure(rank=0, pid=11, exc_type="RuntimeError", message="Connection closed by peer",
                       traceback="Traceback ...\nRuntimeError: Connection closed by peer\n",
                       timestamp_ns=200),
        ProcessFailure(rank=1, pid=12, exc_type="ValueError", message="bad batch",
                       traceback='  File "train.py", line 3\nValueError: bad batch\n', timestamp_ns=100),
    ])
    text = str(error).splitlines()
    assert text[0] == "the launch failed"
    assert text[2] == "[root cause] rank 1 (pid 12): ValueError: bad batch"
    assert '  File "train.py", line 3' in text
    assert str(error).count("Connection closed by peer") == 1
    assert error.root_cause.rank == 1 and error.exitcode == 1


def test_a_timeout_lists_every_rank_with_where_it_stood():
    error = LaunchTimeout("the launch did not finish", [
        ProcessFailure(rank=1, pid=8, stack='  File "train.py", line 9 in step'),
        ProcessFailure(rank=0, pid=7, stack='  File "train.py", line 4 in wait'),
    ])
    text = str(error)
    assert text.index("[stopped at the timeout] rank 0 (pid 7)") < text.index("rank 1 (pid 8)")
    assert 'line 9 in step' in text and isinstance(error, LaunchError)
