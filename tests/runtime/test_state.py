"""The per-deployment state directory: where it lives, that state.json survives round trips and crashes mid-write,
that a damaged one is ignored with a message, and that two commands on one deployment take turns."""

from __future__ import annotations

import os
import threading

from deploykit.runtime.state import Process, State, StateDir, known, root
from tests.waiting import wait_until


def test_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("DEPLOYKIT_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert root() == tmp_path / "xdg" / "deploykit"
    monkeypatch.setenv("DEPLOYKIT_STATE_DIR", str(tmp_path / "env"))
    assert root() == tmp_path / "env"
    assert root(str(tmp_path / "flag")) == tmp_path / "flag"
    monkeypatch.delenv("DEPLOYKIT_STATE_DIR")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert root() == tmp_path / "home" / ".local" / "state" / "deploykit"


def test_state_round_trip_and_known(tmp_path):
    sd = StateDir(tmp_path, "dk")
    p = Process("dk-0", 123, 456, 8001, "/x/dk-0.log", "abc", 0)
    state = State("dk", "local", spec="/s.yaml").with_process(p).with_process(
        Process("dk-lb", 124, 457, 8000, "/x/dk-lb.log", "def", None))
    sd.save(state)
    assert sd.load() == state
    assert known(tmp_path) == ["dk"]
    assert sd.load().without("dk-0").processes[0].name == "dk-lb"
    assert not list(sd.path.glob(".state-*"))  # no temp file left behind


def test_damaged_state_is_ignored_with_a_message(tmp_path, capsys):
    sd = StateDir(tmp_path, "dk")
    sd.create()
    (sd.path / "state.json").write_text("{not json")
    assert sd.load() is None
    assert "ignoring damaged" in capsys.readouterr().err


def test_salt_is_stable_and_private(tmp_path):
    sd = StateDir(tmp_path, "dk")
    assert sd.salt() == sd.salt() and len(sd.salt()) == 16
    assert (sd.path / "salt").stat().st_mode & 0o077 == 0


def test_a_second_command_on_the_same_deployment_waits(tmp_path, capsys):
    sd = StateDir(tmp_path, "dk")
    order = []

    def second():
        with StateDir(tmp_path, "dk").lock():
            order.append("second")

    with sd.lock():
        t = threading.Thread(target=second)
        t.start()
        said: list[str] = []

        def waiting() -> bool:  # the second command says so just before it blocks on the lock
            said.append(capsys.readouterr().err)
            return "waiting for another deploykit command" in "".join(said)
        wait_until(waiting, timeout=10)
        order.append("first done")
    t.join(5)
    assert order == ["first done", "second"]
    with StateDir(tmp_path, "other").lock():  # other deployments do not wait
        pass
    assert os.path.exists(tmp_path / "other" / "lock")
