"""The caller's relay of workers' displays, without a kernel: frames in, messages published.

A sink (the worker's end) and the relay run in this process; the relay's publish is a list.
The real kernel's side is tests/notebooks/test_kernel_displays.py.
"""

from __future__ import annotations

import os

import pytest

from xlaunch.backends.displays import DisplayRelay, own_display_id
from xlaunch.worker.displays import DisplaySink


def relay_and_sinks(ranks=2):
    published = []
    relay = DisplayRelay(lambda *message: published.append(message), ranks)
    sinks = [DisplaySink(os.dup(fd), rank) for rank, fd in enumerate(relay.fds)]
    return relay, sinks, published


def display(sink, text, update=False, display_id="bar"):
    sink("update_display_data" if update else "display_data",
         {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id}},
         {})


def test_a_burst_of_updates_is_folded_and_ends_at_its_last_state():
    relay, (sink, _), published = relay_and_sinks()
    display(sink, "0")
    for step in range(1, 5000):
        display(sink, str(step), update=True)
    relay.close()
    kinds = [message[0] for message in published]
    assert kinds[0] == "display_data"
    assert 1 <= kinds.count("update_display_data") < 100, len(kinds)  # a few a flush, not 4999
    assert published[-1][1]["data"]["text/plain"] == "4999"


def test_each_rank_keeps_its_own_display_ids():
    relay, sinks, published = relay_and_sinks()
    for rank, sink in enumerate(sinks):
        display(sink, f"rank {rank}")
    relay.close()
    ids = {message[1]["transient"]["display_id"] for message in published}
    assert ids == {"bar-rank0", "bar-rank1"}


def test_widget_state_updates_merge_key_by_key():
    relay, (sink, _), published = relay_and_sinks()
    sink("comm_open", {"comm_id": "w", "target_name": "jupyter.widget",
                       "data": {"state": {"value": 0, "max": 10}}}, {})
    sink("comm_msg", {"comm_id": "w", "data": {"method": "update", "state": {"value": 5}}}, {})
    sink("comm_msg", {"comm_id": "w", "data": {"method": "update",
                                               "state": {"bar_style": "success"}}}, {})
    relay.close()
    updates = [m[1]["data"]["state"] for m in published if m[0] == "comm_msg"]
    merged = {}
    for state in updates:
        merged.update(state)
    assert merged == {"value": 5, "bar_style": "success"}
    assert published[0][0] == "comm_open"


def test_messages_without_a_display_id_are_left_as_they_are():
    content = {"data": {"text/plain": "x"}, "metadata": {}, "transient": {}}
    assert own_display_id(content, 3) is content


def test_a_sink_in_a_process_the_worker_forked_sends_nothing():
    relay, (sink, _), published = relay_and_sinks()
    pid = os.fork()
    if pid == 0:  # a process the rank started (a DataLoader worker): not the rank
        os._exit(0 if not sink("display_data", {"data": {}}, {}) else 1)
    _, status = os.waitpid(pid, 0)
    relay.close()
    assert os.waitstatus_to_exitcode(status) == 0 and published == []


def test_a_redrawn_line_goes_to_the_live_line_and_plain_lines_to_the_stream():
    import io

    from xlaunch.worker.output import PrefixedStream

    shown = []

    def live(text, line):
        shown.append((text, line))
        return line if line is not None else len({n for _, n in shown if n is None})

    out = io.StringIO()
    stream = PrefixedStream(out, "[rank 1] ", live=live)
    stream.write("before\n")
    for step in range(3):  # as tqdm writes: carriage return, the bar, a flush
        stream.write(f"\rstep {step}")
        stream.flush()
    stream.write("\n")
    stream.write("after\n")
    stream.write("\rsecond bar\r")
    stream.write("\n")
    assert out.getvalue() == "[rank 1] before\n[rank 1] after\n"
    assert shown[0] == ("[rank 1] step 0", None)  # a new live line
    assert ("[rank 1] step 2", 1) in shown and shown[-1] == ("[rank 1] second bar", None)


def test_a_line_several_ranks_print_alike_shows_once_with_its_ranks():
    from xlaunch.backends.lines import TextFolder, rank_ranges

    folder = TextFolder(fold=True)
    for rank in (2, 0, 1, 3):
        folder.add(rank, "stdout", [(f"[rank {rank}] ", "epoch 1 done\n")], now=10.0)
    folder.add(0, "stdout", [("[rank 0] ", "loss 0.5\n")], now=10.01)
    folder.add(1, "stdout", [("[rank 1] ", "loss 0.6\n")], now=10.02)
    assert folder.due(now=10.1) == []  # still within the window: others may print it too
    assert folder.due(now=11.0) == [("stdout", "[ranks 0-3] epoch 1 done\n[rank 0] loss 0.5\n"
                                                "[rank 1] loss 0.6\n")]
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_folding_keeps_each_ranks_order_and_can_be_turned_off():
    from xlaunch.backends.lines import TextFolder

    folder = TextFolder(fold=True)
    folder.add(0, "stdout", [("[rank 0] ", "a\n")], now=1.0)
    folder.add(1, "stdout", [("[rank 1] ", "b\n"), ("[rank 1] ", "a\n")], now=1.0)
    # rank 1 printed "a" after "b": its "b" moves before the folded "a"
    assert folder.due(everything=True) == [("stdout", "[rank 1] b\n[ranks 0-1] a\n")]
    shared = TextFolder(fold=True)
    shared.add(0, "stdout", [("[rank 0] ", "a\n")], now=1.0)
    shared.add(1, "stdout", [("[rank 1] ", "b\n")], now=1.0)
    shared.add(2, "stdout", [("[rank 2] ", "b\n"), ("[rank 2] ", "a\n")], now=1.0)
    # rank 2's "b" is rank 1's too: it cannot move, so rank 2's "a" does not join
    assert shared.due(everything=True) == [
        ("stdout", "[rank 0] a\n[ranks 1-2] b\n[rank 2] a\n")]
    late = TextFolder(fold=True)
    late.add(0, "stderr", [("[rank 0] ", "same\n")], now=1.0)
    late.add(1, "stderr", [("[rank 1] ", "same\n")], now=2.0)  # not close together
    assert late.due(everything=True) == [("stderr", "[rank 0] same\n[rank 1] same\n")]
    off = TextFolder(fold=False)
    off.add(0, "stdout", [("[rank 0] ", "same\n")], now=1.0)
    off.add(1, "stdout", [("[rank 1] ", "same\n")], now=1.0)
    assert off.due(everything=True) == [("stdout", "[rank 0] same\n[rank 1] same\n")]


def test_the_live_views_states_come_from_the_launch_folders_marks(tmp_path):
    """No kernel: the view's rows read from a launch folder as the workers leave it."""
    from xlaunch.backends.live_view import LiveView

    published = []
    view = LiveView(lambda *message: published.append(message), str(tmp_path), 3)
    attempt = tmp_path / "attempt-0"
    attempt.mkdir()
    assert [row[1] for row in view.rows()] == ["starting"] * 3
    for rank in range(3):
        (attempt / f"pid-{rank}").write_text(f"{1000 + rank} {rank}")
    (attempt / "returned-0").touch()
    (attempt / "failure-1.json").write_text("{}")
    view.saw_text(2, [("[rank 2] ", "step 1\n"), ("", "loss 0.25\n")])
    view.saw_display(0, "comm_msg", {"data": {"method": "update",
                                              "state": {"value": "5/10 [00:01&lt;00:01]"}}})
    rows = view.rows()
    assert [(rank, state, last) for rank, state, _, last in rows] == [
        (0, "finished", "5/10 [00:01<00:01]"), (1, "failed", ""), (2, "running", "loss 0.25")]
    view.tick(now=100.0)
    view.tick(now=100.1)  # within the refresh interval: nothing
    view.tick(now=101.0)  # nothing changed: nothing
    assert [message[0] for message in published] == ["display_data"]
    view.owner_stopped = lambda: True  # the owner stopped the workers: a running rank is stopped
    assert view.rows()[2][1] == "stopped"
    view.tick(now=102.0)
    view.finish(None)
    assert [message[0] for message in published] == ["display_data", "update_display_data",
                                                     "update_display_data"]
    assert published[-1][1]["data"] == {"text/plain": ""}


def test_the_relay_outlives_what_it_cannot_take_holds_no_worker_and_loses_no_text(capsys):
    """A piece of text that is not text (its folding fails), a message that cannot be read:
    the relay goes on reading, so a worker is never held at its next print (its send blocks
    when nobody reads), and what it could not fold or read is shown as it came."""
    import re
    import socket
    import threading
    import time

    from xlaunch.backends.lines import WINDOW_S
    from xlaunch.worker.displays import TEXT

    relay, (sink, _), published = relay_and_sinks()
    send = sink.lines("stdout")
    send([("", 5)])
    sink(TEXT, {"name": "stdout", "pieces": "not pieces"}, None)
    raw = socket.socket(fileno=os.dup(relay.fds[1]))  # rank 1: a frame that does not unpickle
    with pytest.warns(RuntimeWarning, match="a worker's message could not be shown"):
        raw.sendall(len(b"junk").to_bytes(4, "big") + b"junk")
        time.sleep(0.5)
    raw.close()
    time.sleep(4 * WINDOW_S)  # the relay has tried to show the piece that is not text

    def prints():
        for step in range(5000):  # far more than the socket holds unread
            send([("[rank 0] ", f"line {step} " + "x" * 60 + "\n")])

    printer = threading.Thread(target=prints, daemon=True)
    printer.start()
    printer.join(60)
    try:
        assert not printer.is_alive(), "the worker was held at its print: the relay stopped reading"
        display(sink, "after")
    finally:
        relay.close()  # a worker still held is let go: its socket is closed
    shown = "".join(message[1]["text"] for message in published if message[0] == "stream")
    numbers = [int(n) for n in re.findall(r"\[rank 0\] line (\d+) x{60}\n", shown)]
    assert numbers == list(range(5000))  # every line, in order
    assert shown.index("5") < shown.index("[rank 0] line 0 ")  # the piece that was not text
    assert "'not pieces'" in capsys.readouterr().out  # what could not be read: the caller's stream
    assert ("display_data", "after") in [(m[0], m[1].get("data", {}).get("text/plain"))
                                         for m in published]
