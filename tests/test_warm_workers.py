"""The warm template's choice of worker command (launch/warm.py). The template serving real trials: the one
end-to-end tune run (tests/test_tune_sweep.py)."""

from __future__ import annotations

import os


def test_workers_fork_from_the_template_only_for_this_process_and_only_while_it_is_up(tmp_path, monkeypatch):
    """A job this process launches uses the template's socket; one whose process merely inherited the variable
    (a job submitted elsewhere), or that finds no socket, starts its worker cold."""
    from zerotune.launch import warm

    args = ("123", "/run", "token")
    socket_file = tmp_path / "template.sock"
    socket_file.touch()
    monkeypatch.setenv(warm.WARM_ENV, f"{socket_file}:{os.getpid()}")
    assert warm.worker_args("BOOT", args) == ("-u", "-c", warm.STUB, str(socket_file), *args)
    monkeypatch.setenv(warm.WARM_ENV, f"{socket_file}:{os.getpid() + 1}")
    assert warm.worker_args("BOOT", args) == ("-u", "-c", "BOOT", *args)
    monkeypatch.setenv(warm.WARM_ENV, f"{tmp_path / 'gone.sock'}:{os.getpid()}")
    assert warm.worker_args("BOOT", args) == ("-u", "-c", "BOOT", *args)
    monkeypatch.delenv(warm.WARM_ENV)
    assert warm.worker_args("BOOT", args) == ("-u", "-c", "BOOT", *args)
