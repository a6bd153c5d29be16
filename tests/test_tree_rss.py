"""The job's host peak sums its processes' RSS (host/memory.py ProcessTree): a child that has not exec'd
yet (a subprocess between fork and exec, a fork that never execs) shares its parent's pages and must not
count them again; a child running a program of its own counts in full."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from zerotune.host.memory import ProcessTree

MIB = 2**20


def test_a_forked_child_does_not_count_its_parents_pages_again():
    block = b"\x01" * (300 * MIB)  # resident in this process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never execs, never touches the block
        os.close(read)
        os.write(write, b"x")
        signal.pause()
        os._exit(0)
    os.close(write)
    try:
        os.read(read, 1)
        tree = ProcessTree(os.getpid())
        assert pid in tree.pids()
        parent = psutil.Process().memory_info().rss
        assert psutil.Process(pid).memory_info().rss > 250 * MIB  # what a plain RSS sum would add again
        assert tree.rss_bytes(tree.pids()) < parent + 100 * MIB
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
    assert len(block) == 300 * MIB


def test_a_child_running_its_own_program_counts_in_full():
    code = "import sys; b = b'\\x01' * (200 * 2**20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        tree = ProcessTree(os.getpid())
        parent = psutil.Process().memory_info().rss
        assert tree.rss_bytes(tree.pids()) > parent + 200 * MIB
    finally:
        child.kill()
        child.wait()
