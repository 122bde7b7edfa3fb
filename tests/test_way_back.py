"""The way back from the workers: what they send is private, whole, or its loss is named.

Tried as a careless or hostile user would: another local user watching ``/tmp`` and ``/dev/shm``
during a launch, a rank killed while it sends a large result, a shared memory that fills up, a
notebook that keeps a thousand results, a rank blocked in C code when the timeout passes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = os.geteuid() == 0
LINUX = sys.platform.startswith("linux")


def run_script(tmp_path: Path, body: str, *, timeout: float = 180, wrap: list[str] | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    command = [*(wrap or []), sys.executable, str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu", **(env or {})})


def last_json(result: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# A watcher thread lists every path under the temporary directory and /dev/shm, whatever its name,
# as often as it can while the launch runs, under a umask that would make files world-writable;
# both are listed before and after too. Rank 1 waits so that rank 0's value is there to be seen.
# As root (CI) the launch runs in a private mount namespace with a /dev/shm of its own and a
# temporary directory of its own, so every entry that appears is the launch's; elsewhere /dev/shm
# is shared with the machine's other processes, and only the launch's names are watched there.
WATCHED = """
    import json, os, stat, sys, tempfile, threading, time
    import torch, xlaunch
    os.umask(0)  # whatever the user's umask, nothing is readable by others
    seen, stop = {}, threading.Event()
    roots = [tempfile.gettempdir(), "/dev/shm"]
    prefix = f"xlaunch-{os.getpid()}-"
    every_name = sys.argv[-1] == "every-name"  # /dev/shm is this launch's alone
    def tops(root):
        names = os.listdir(root)
        if root == "/dev/shm" and not every_name:
            names = [n for n in names if n.startswith(prefix)]
        return [os.path.join(root, n) for n in names]
    def listed():
        found = {}
        for root in roots:
            for top in tops(root):
                found[top] = None
                for folder, dirs, files in os.walk(top):
                    for name in [folder] + [os.path.join(folder, f) for f in dirs + files]:
                        found[name] = None
        return found
    def watch():
        while not stop.is_set():
            for name in listed():
                try:
                    seen[name] = os.lstat(name).st_mode
                except OSError:
                    pass
    def work(fail):
        rank = xlaunch.ProcessState().process_index
        if rank == 1:
            time.sleep(0.6)
            if fail:
                raise ValueError("x" * 20_000)  # cut in the error: its whole text is kept
        return torch.ones(4 * 2**20)  # 16 MiB: its bytes go to a file of their own
    before = listed()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    fail = sys.argv[-2] == "fail"
    kept = None
    try:
        value = xlaunch.notebook_launcher(work, args=(fail,), num_processes=2)
        assert torch.equal(value, torch.ones(4 * 2**20))
    except xlaunch.LaunchError as error:
        kept = error.root_cause.full_text
    stop.set()
    watcher.join()
    left = [name for name in listed() if name not in before]
    kept_mode = oct(os.stat(kept).st_mode & 0o777) if kept else None
    folder_mode = oct(os.stat(os.path.dirname(kept)).st_mode & 0o777) if kept else None
    print(json.dumps({"seen": {n: m for n, m in seen.items() if n not in before}, "left": left,
                      "kept": kept, "kept_mode": kept_mode, "folder_mode": folder_mode,
                      "temp": tempfile.gettempdir()}))
"""
PRIVATE_NAMESPACE = ROOT and LINUX and shutil.which("unshare") is not None


@pytest.mark.skipif(not LINUX, reason="/dev/shm and /proc are Linux's")
@pytest.mark.parametrize("how", ["returns", "fail"])
def test_nothing_a_launch_keeps_is_readable_by_another_user_at_any_moment(
        tmp_path: Path, how: str) -> None:
    script = tmp_path / "watched.py"
    script.write_text(textwrap.dedent(WATCHED))
    cache, temp = tmp_path / "cache", tmp_path / "temp"
    temp.mkdir()
    command = [sys.executable, str(script), how, "launch-names"]
    if PRIVATE_NAMESPACE:  # a /dev/shm of its own: every name in it is watched
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs -o size=512m tmpfs /dev/shm && exec "$@"', "sh",
                   *command[:-1], "every-name"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu",
                                 "XDG_CACHE_HOME": str(cache), "TMPDIR": str(temp)})
    facts = last_json(result)
    assert facts["temp"] == str(temp)
    seen = facts["seen"]
    assert any("/dev/shm/" in name and name.endswith("attempt-0-value-0") for name in seen) or how == "fail"
    assert any(Path(name).name.startswith("pid-") for name in seen)
    for name, mode in seen.items():  # whatever its name, nothing others can read
        wanted = 0o700 if stat.S_ISDIR(mode) else 0o600
        assert stat.S_ISDIR(mode) or stat.S_ISREG(mode), name
        assert mode & 0o777 == wanted, f"{name}: {oct(mode & 0o777)}"
    assert facts["left"] == [], facts["left"]  # and nothing new after
    if how == "fail":  # the whole text of the cut failure: in the user's cache, 0600 in 0700
        assert facts["kept"].startswith(str(cache)), facts["kept"]
        assert (facts["kept_mode"], facts["folder_mode"]) == ("0o600", "0o700")


# Another user (nobody) against one launch, step by step (the ranks wait for each step):
# - as soon as the launch's folder in /dev/shm exists: plant a file 0666 where rank 0's value will
#   go (the original exploit: the caller would then map the planted file);
# - once rank 0's value file is there: list the folder, read, replace the value, plant another,
#   redirect one through a symlink;
# - after notebook_launcher returned: write zeros where the value was (its folder made anew by
#   nobody), reach the caller's mapping through /proc; the caller's tensor stays as returned.
# Each refusal must be a permission error: a "No such file" would mean the attempt missed.
SECOND_USER = """
    import json, os, shutil, sys, tempfile, threading, time, torch, xlaunch
    from pathlib import Path
    steps = Path(sys.argv[1])
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    def nobody(*command):
        # posix_spawn, what it says to a file: no pipe (subprocess's own included) that a worker
        # the launch forks meanwhile would hold open, and wait on, would hold this thread up.
        with tempfile.TemporaryFile("w+") as said:
            actions = [(os.POSIX_SPAWN_DUP2, said.fileno(), 1), (os.POSIX_SPAWN_DUP2, said.fileno(), 2)]
            pid = os.posix_spawnp(as_nobody[0], as_nobody + list(command), os.environ,
                                  file_actions=actions)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            said.seek(0)
            return [code, said.read().strip()]
    def wait_for(found, what, limit=150.0):
        deadline = time.monotonic() + limit
        while not found():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} never came")
            time.sleep(0.005)
        return found()
    def shm_folder():
        mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"xlaunch-{os.getpid()}-")]
        return f"/dev/shm/{mine[0]}" if mine else None
    facts = {}
    def against_the_launch():
        shm = wait_for(shm_folder, "the launch's folder in /dev/shm")
        value = f"{shm}/attempt-0-value-0"
        facts["folder"] = shm
        facts["before"] = {"plant": nobody("sh", "-c", f"umask 0; echo x > {value}")}
        (steps / "planted").touch()  # rank 0 may return now
        facts["value_file"] = wait_for(lambda: os.path.exists(value), "rank 0's value file")
        facts["during"] = {
            "list": nobody("ls", shm), "read": nobody("cat", value),
            "replace": nobody("sh", "-c", f"echo x > {value}"),
            "plant": nobody("sh", "-c", f"echo x > {shm}/attempt-0-value-9"),
            "redirect": nobody("ln", "-s", "/etc/passwd", f"{shm}/attempt-0-value-8")}
        (steps / "tried").touch()  # rank 1 may return now: the launch ends
    def work(steps):
        rank = xlaunch.ProcessState().process_index
        step = steps / ("planted" if rank == 0 else "tried")
        wait_for(step.exists, step.name)
        return torch.full((2**20,), 3.0)
    watcher = threading.Thread(target=against_the_launch)
    watcher.start()
    t = xlaunch.notebook_launcher(work, args=(steps,), num_processes=2)
    watcher.join()
    shm, pid = facts["folder"], os.getpid()
    facts["after"] = {
        "rewrite": nobody("sh", "-c", f"mkdir -p {shm} && head -c {4 * 2**20} /dev/zero > "
                                      f"{shm}/attempt-0-value-0"),
        "maps": nobody("ls", f"/proc/{pid}/map_files"),
        "memory": nobody("sh", "-c", f"head -c 4096 /dev/zero > /proc/{pid}/mem")}
    shutil.rmtree(shm, ignore_errors=True)  # nobody's folder: the caller removes it
    facts["first"] = float(t[0])
    facts["whole"] = bool(torch.equal(t, torch.full((2**20,), 3.0)))
    print(json.dumps(facts))
"""


@pytest.mark.skipif(not (ROOT and LINUX and shutil.which("setpriv")),
                    reason="needs root to act as a second user (CI runs as root)")
def test_a_second_user_cannot_read_replace_or_redirect_a_returned_value(tmp_path: Path) -> None:
    steps = tmp_path / "steps"
    steps.mkdir()
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SECOND_USER))
    facts = last_json(subprocess.run(
        [sys.executable, str(script), str(steps)], capture_output=True, text=True, timeout=240,
        env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}))
    assert facts["value_file"], facts  # the value's file was there while nobody tried
    refused = {**{f"before {k}": v for k, v in facts["before"].items()},
               **{f"during {k}": v for k, v in facts["during"].items()},
               "after maps": facts["after"]["maps"], "after memory": facts["after"]["memory"]}
    for what, (code, said) in refused.items():  # refused for want of permission, not missed
        assert code != 0 and "Permission denied" in said, (what, said)
        assert "No such file" not in said, (what, said)
    # The original exploit: whatever nobody writes where the value was, after the launch
    # returned, the caller's tensor is what the function returned.
    assert facts["after"]["rewrite"][0] == 0, facts["after"]  # written: to a file of its own
    assert facts["first"] == 3.0 and facts["whole"], facts


def test_a_spill_folder_of_another_user_is_never_used_for_a_value(tmp_path: Path) -> None:
    from xlaunch.worker.launch_dir import LaunchDir

    launch = LaunchDir.create()
    spill = Path(tempfile.gettempdir()) / Path(launch.folder).name
    try:
        if not launch.folder.startswith("/dev/shm/"):
            pytest.skip("no shared memory here: the launch's folder is on disk already")
        assert stat.S_IMODE(Path(launch.folder).stat().st_mode) == 0o700
        assert launch.spill() is None and not spill.exists()  # made only when a value needs it
        assert launch.spill(make=True) == spill and stat.S_IMODE(spill.stat().st_mode) == 0o700
        spill.chmod(0o755)  # a folder others can read is not the launch's: no value goes there
        assert launch.spill() is None
        if ROOT:
            spill.chmod(0o700)
            os.chown(spill, 65534, 65534)  # nor is one another user made first
            assert launch.spill() is None and launch.spill(make=True) is None
    finally:
        launch.remove()
    assert not Path(launch.folder).exists()
    assert spill.exists() == ROOT  # a folder that is not the user's own is not theirs to remove
    shutil.rmtree(spill, ignore_errors=True)


# Rank 0 kills itself (SIGKILL, as the out-of-memory killer would) at a random moment once it has
# begun to send its 192 MiB tensor back (its "sending" mark written): while its bytes are written,
# or just after its value is whole.
KILLED_WHILE_SENDING = """
    import json, os, random, signal, threading, time, torch, xlaunch
    from pathlib import Path
    from xlaunch.names import STORE_DIR_VAR
    from xlaunch.worker.launch_dir import Mark
    def work(delay):
        big = torch.arange(48 * 2**20, dtype=torch.float32)
        if xlaunch.ProcessState().process_index == 0:
            began = Path(os.environ[STORE_DIR_VAR], f"{Mark.SENDING}-0")  # the attempt's folder
            def kill_while_sending():
                while not began.exists():
                    time.sleep(0.001)
                time.sleep(delay)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=kill_while_sending, daemon=True).start()
        return big
    random.seed(7)
    outcomes = []
    for run in range(20):
        try:
            value = xlaunch.notebook_launcher(work, args=(random.uniform(0.0, 0.05),),
                                              num_processes=2)
        except xlaunch.LaunchError as error:
            cause, text = error.root_cause, str(error)
            outcomes.append(["error", cause.rank, cause.exitcode, "while sending" in text,
                             "its function returned, then" in text])
        else:
            whole = value is not None and torch.equal(value, torch.arange(48 * 2**20, dtype=torch.float32))
            outcomes.append(["value", whole])
    print(json.dumps(outcomes))
"""


@pytest.mark.skipif(not LINUX, reason="/dev/shm is Linux's")
def test_a_rank_killed_while_sending_its_result_is_the_root_cause_never_none(
        tmp_path: Path) -> None:
    result = run_script(tmp_path, KILLED_WHILE_SENDING, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(outcomes) == 20
    for outcome in outcomes:
        if outcome[0] == "value":
            assert outcome[1], outcomes  # whole: never None, never part of it
            continue
        # rank 0 by the signal that killed it, never its peer that was stopped ...
        assert outcome[1:3] == [0, -signal.SIGKILL], outcomes
        # ... and said to have died while sending, unless its value was whole by then
        assert outcome[3] != outcome[4], outcomes
    while_sending = [outcome for outcome in outcomes if outcome[0] == "error" and outcome[3]]
    assert len(while_sending) >= 5, outcomes  # the kills did land while the bytes were written


# A shared memory that fills up while the value's bytes are written (the room check passed): the
# bytes go to the launch's spill folder on disk; both full is an error naming the full file
# systems.
# In a private mount namespace: /dev/shm and the temporary directory are tmpfs of its own.
# - "direct": write_value itself, its room check told to say yes, against a 24 MiB /dev/shm;
# - "checked": a launch whose 32 MiB value does not pass the room check of a 24 MiB /dev/shm;
# - "small parts": the same for a value of many small tensors (48 MiB of 32 KiB each, which
#   travel inside the pickle stream: the stream is written as a large buffer is);
# - "shm full": a launch with a /dev/shm of 4 MiB, nearly full: its folder is on disk;
# - "launch": a launch whose 256 MiB value passes the room check of a 600 MiB /dev/shm, which
#   the caller shrinks (a remount) once rank 0's first buffer is there: the writes after it find no
#   room (or meet ENOSPC), as when another program fills /dev/shm meanwhile.
FULL = """
    import ctypes, json, os, sys, tempfile, threading, time, torch, xlaunch
    from pathlib import Path
    from xlaunch.worker import value as value_module
    from xlaunch.worker.launch_dir import LaunchDir
    libc = ctypes.CDLL(None, use_errno=True)
    def shm_size(size):  # mount -o remount,size=... /dev/shm
        return libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 32, f"size={size}".encode()) == 0
    facts = {}
    assert shm_size(24 * 2**20)
    big = torch.arange(8 * 2**20, dtype=torch.float32)  # 32 MiB, /dev/shm holds 24
    value_module.ROOM_TO_SPARE = -2**40  # the room check says yes: the write itself meets ENOSPC
    launch = LaunchDir.create()
    attempt = launch.attempt_dir(0)
    try:
        value_module.write_value(launch, attempt, {"t": big})
        shm_left = [name for name in os.listdir(launch.folder) if "value" in name]
        ok, back = value_module.read_value(attempt)
        facts["direct"] = [ok, torch.equal(back["t"], big), shm_left]
    except OSError as error:
        facts["direct"] = ["error", type(error).__name__, str(error)]
    launch.remove()
    value_module.ROOM_TO_SPARE = 256 * 2**20
    def launched(facts_key, value, equal):
        try:
            back = xlaunch.notebook_launcher(lambda: value, num_processes=2)
            facts[facts_key] = ["value", equal(back)]
        except xlaunch.LaunchError as error:
            facts[facts_key] = ["error", error.root_cause.rank, error.root_cause.exc_type,
                                str(error)]
    launched("checked", big, lambda back: torch.equal(back, big))
    parts = [torch.full((2**13,), float(i)) for i in range(1536)]  # 32 KiB each: 48 MiB
    launched("small parts", parts, lambda back: len(back) == len(parts)
             and all(torch.equal(a, b) for a, b in zip(back, parts)))
    assert shm_size(4 * 2**20)
    launched("shm full", torch.ones(4), lambda back: torch.equal(back, torch.ones(4)))
    assert shm_size(600 * 2**20)
    many = [torch.full((2**18,), float(i)) for i in range(256)]  # 256 buffers of 1 MiB
    seen = {"on disk": set()}
    def shrink_when_written():
        mine = f"xlaunch-{os.getpid()}-"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "remounted" not in seen:
            for name in [n for n in os.listdir("/dev/shm") if n.startswith(mine)]:
                if os.path.exists(f"/dev/shm/{name}/attempt-0-value-0"):
                    for _ in range(1000):  # below what is used already, a remount is refused
                        room = os.statvfs("/dev/shm")
                        used = (room.f_blocks - room.f_bfree) * room.f_frsize
                        if shm_size(used + 4 * 2**20):
                            seen["remounted"] = used
                            break
            time.sleep(0.0005)
        while time.monotonic() < deadline and not done.is_set():  # where the rest went
            for folder, _, files in os.walk(tempfile.gettempdir()):
                seen["on disk"] |= {f for f in files if "-value-" in f}
            time.sleep(0.001)
    done = threading.Event()
    watcher = threading.Thread(target=shrink_when_written)
    watcher.start()
    launched("launch", many, lambda back: all(torch.equal(a, b) for a, b in zip(back, many))
             and len(back) == len(many))
    done.set()
    watcher.join()
    facts["remounted"] = seen.get("remounted")
    facts["on disk"] = len(seen["on disk"])
    print(json.dumps(facts))
"""


@pytest.mark.skipif(not (ROOT and LINUX and shutil.which("unshare")),
                    reason="needs root for a private mount namespace (CI runs as root)")
@pytest.mark.parametrize("disk", ["320m", "8m"])
def test_a_full_shared_memory_falls_back_to_disk_or_names_the_full_file_systems(
        tmp_path: Path, disk: str) -> None:
    temp = tmp_path / "small-temp"
    temp.mkdir()
    (tmp_path / "script.py").write_text(textwrap.dedent(FULL))
    mounts = (f"mount -t tmpfs -o size=4m tmpfs /dev/shm && "
              f"mount -t tmpfs -o size={disk} tmpfs {temp} && "
              f"exec {sys.executable} {tmp_path / 'script.py'}")
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", mounts],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu", "TMPDIR": str(temp)})
    facts = last_json(result)
    assert facts["remounted"], facts  # the room check passed: rank 0 wrote its first buffer
    if disk != "8m":  # room on disk: the value arrives whole, nothing half-written stays
        assert facts["direct"] == [True, True, []], facts
        assert facts["checked"] == ["value", True], facts
        assert facts["small parts"] == ["value", True], facts
        assert facts["shm full"] == ["value", True], facts
        assert facts["launch"] == ["value", True], facts
        assert facts["on disk"] > 0, facts  # the buffers after the remount went to disk
        return
    kind, name, text = facts["direct"]
    assert (kind, name) == ("error", "ValueNotSent"), facts
    assert "/dev/shm" in text and str(temp) in text and "full" in text, text
    assert facts["shm full"] == ["value", True], facts  # a few bytes: room on the 8 MiB disk
    for half in ("checked", "small parts", "launch"):
        assert facts[half][:3] == ["error", 0, "ValueNotSent"], facts
        assert "full" in facts[half][3] and "TypeError" not in facts[half][3], facts
        assert str(temp) in facts[half][3], facts
    assert "/dev/shm" in facts["launch"][3], facts  # written there first, until it filled up


# A notebook that keeps a thousand returned tensors (each large enough to be mapped) under a
# descriptor limit of 128: none of them holds a descriptor, and their pages go with them.
KEPT = """
    import json, os, resource, torch, xlaunch
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    def work(n):
        return [torch.full((2**14,), float(n * 10 + i)) for i in range(10)]  # 64 KiB each
    kept = []
    fds = len(os.listdir("/proc/self/fd"))
    for n in range(100):
        kept += xlaunch.notebook_launcher(work, args=(n,), num_processes=2)
    right = all(float(t[0]) == i and t.numel() == 2**14 for i, t in enumerate(kept))
    after = len(os.listdir("/proc/self/fd"))
    mapped = sum("/dev/shm/xlaunch-" in line for line in open("/proc/self/maps"))
    kept.clear()
    unmapped = sum("/dev/shm/xlaunch-" in line for line in open("/proc/self/maps"))
    print(json.dumps({"right": right, "fds": [fds, after], "mapped": [mapped, unmapped]}))
"""


@pytest.mark.skipif(not LINUX, reason="/proc is Linux's")
def test_a_thousand_kept_results_hold_no_descriptor(tmp_path: Path) -> None:
    facts = last_json(run_script(tmp_path, KEPT, timeout=400))
    assert facts["right"]
    assert facts["fds"][1] <= facts["fds"][0] + 2, facts  # flat, not one per kept tensor
    assert facts["mapped"] == [1000, 0], facts


# Both ranks blocked in a C call when the timeout passes: asking for their stacks interrupts the
# call (the signal's handler runs) and the function returns while they are being stopped; the
# verdict is still the timeout, with the last Python frame of each.
IN_C = """
    import ctypes, json, xlaunch
    def work():
        ctypes.CDLL(None).sleep(1000)
        return "returned"
    xlaunch.notebook_launcher(print, num_processes=2)  # the caller's first import of torch's
    verdicts = []                                      # parts is paid before the timed launches
    for _ in range(20):
        try:
            xlaunch.notebook_launcher(work, num_processes=2, timeout=1.0)
            verdicts.append("returned")
        except xlaunch.LaunchTimeout as error:
            verdicts.append("timeout" if " in work" in str(error) else str(error))
        except xlaunch.LaunchError as error:
            verdicts.append(str(error)[:300])
    print(json.dumps(verdicts))
"""


def test_a_rank_in_c_code_at_the_timeout_is_a_timeout_every_time(tmp_path: Path) -> None:
    result = run_script(tmp_path, IN_C, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdicts == ["timeout"] * 20, verdicts


def test_a_kept_failure_text_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from xlaunch.worker import private

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for number in range(private.KEPT_TEXTS + 5):
        source = tmp_path / f"failure-{number}.txt"
        source.write_bytes(b"y" * (private.KEPT_TEXT_BYTES + 10))
        kept = private.keep_whole_text(source, rank=number)
        assert kept is not None
    texts = list(private.failures_folder().glob("rank*.txt"))
    assert len(texts) == private.KEPT_TEXTS  # the newest only
    assert all(t.stat().st_size < private.KEPT_TEXT_BYTES + 100 for t in texts)
    assert all(stat.S_IMODE(t.stat().st_mode) == 0o600 for t in texts)


def test_the_output_lock_is_made_with_the_launch_folder_and_workers_only_open_it(
        tmp_path: Path) -> None:
    import io

    from xlaunch.worker.launch_dir import OUTPUT_LOCK, LaunchDir
    from xlaunch.worker.output import PrefixedStream

    umask = os.umask(0)  # whatever the user's umask
    try:
        launch = LaunchDir.create()
    finally:
        os.umask(umask)
    try:
        lock = Path(launch.folder) / OUTPUT_LOCK
        info = lock.lstat()  # there before any worker: made exclusively, 0600, with the folder
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        out = io.StringIO()
        PrefixedStream(out, "[rank 0] ", str(lock)).write("under the lock\n")
        assert out.getvalue() == "[rank 0] under the lock\n"
    finally:
        launch.remove()
    absent = tmp_path / OUTPUT_LOCK  # a worker never creates it: without it, lines go unlocked
    out = io.StringIO()
    PrefixedStream(out, "[rank 1] ", str(absent)).write("no lock\n")
    assert out.getvalue() == "[rank 1] no lock\n" and not absent.exists()
