"""exit_now: the status, exit handlers, open threads and buffered output of a normal exit, without the teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from zerotune.host.process import exit_status


def run(body: str) -> subprocess.CompletedProcess:
    code = "import atexit, sys, threading, time\nfrom zerotune.host.process import exit_now\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (2, 2), (130, 130), (256 + 3, 3)])
def test_status_as_the_interpreter_gives_it(code, status):
    assert exit_status(code) == status


def test_a_message_is_printed_and_exits_1(capsys):
    assert exit_status("zerotune worker: gone") == 1
    assert "zerotune worker: gone" in capsys.readouterr().err


def test_handlers_and_buffers_are_kept():
    done = run("""
        atexit.register(lambda: print("handler ran", flush=True))
        sys.stdout.write("buffered, no newline")
        exit_now(3)
    """)
    assert done.returncode == 3
    assert done.stdout.index("buffered, no newline") < done.stdout.index("handler ran")


def test_a_running_thread_gets_the_normal_exit():
    """A non-daemon thread that waits for the interpreter's shutdown signal (concurrent.futures, joblib's
    executor) would never end if exit_now joined it: such a process exits the normal way."""
    done = run("""
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1)
        pool.submit(time.sleep, 0.2)
        def slow():
            time.sleep(0.3)
            print("thread finished", flush=True)
        threading.Thread(target=slow).start()
        exit_now(4)
    """)
    assert done.returncode == 4 and "thread finished" in done.stdout


def test_the_teardown_is_skipped():
    """An object whose finaliser runs only in the interpreter's teardown: a normal exit prints it, exit_now not."""
    body = """
        class Noisy:
            def __del__(self):
                print("torn down", flush=True)
        keep = Noisy()
        {end}
    """
    assert "torn down" in run(body.format(end="sys.exit(0)")).stdout
    skipped = run(body.format(end="exit_now(0)"))
    assert skipped.returncode == 0 and "torn down" not in skipped.stdout


def test_a_profiler_still_gets_its_output(tmp_path):
    """Under `python -m cProfile -o`, exit_now exits normally: the profile is written after the script returns."""
    script = tmp_path / "prog.py"
    script.write_text("from zerotune.host.process import exit_now\nexit_now(0)\n")
    out = tmp_path / "prof.out"
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), str(script)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert out.is_file() and out.stat().st_size > 0
