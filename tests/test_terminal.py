"""The keyboard around a streamed reply, on a real pseudo-terminal: each check runs in a child
process whose controlling terminal it is (pty.fork), as `chatcli chat` runs in a shell."""

import json
import os
import pty
import signal
import subprocess
import sys
import textwrap

from chatcli.terminal.keyboard import quiet_keyboard


def _in_a_terminal(code: str) -> dict:
    """Runs `code` in a child on a new pseudo-terminal; what it writes to `report` (a dict,
    as JSON) comes back."""
    read_end, write_end = os.pipe()
    pid, leader = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, its job the foreground
        os.close(read_end)
        # fd 0 is the pty; pytest's sys.stdin is a stand-in without a file descriptor.
        sys.stdin = os.fdopen(0, "r", closefd=False)
        scope = {"report": {}}
        try:
            exec(textwrap.dedent(code), scope)
        except BaseException as e:
            scope["report"]["error"] = repr(e)
        finally:
            os.write(write_end, json.dumps(scope["report"]).encode())
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 4096):
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    os.close(read_end)
    os.close(leader)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(b"".join(chunks) or b"{}")


def test_echo_is_off_while_a_reply_streams_and_back_after():
    report = _in_a_terminal(
        """
        import sys, termios
        from chatcli.terminal.keyboard import quiet_keyboard
        modes = lambda: termios.tcgetattr(sys.stdin.fileno())[3]
        report["before"] = bool(modes() & termios.ECHO)
        with quiet_keyboard():
            report["during"] = bool(modes() & (termios.ECHO | termios.ECHOCTL))
            report["isig"] = bool(modes() & termios.ISIG)  # Ctrl-C still stops the reply
        report["after"] = bool(modes() & termios.ECHO)
        """
    )
    assert report == {"before": True, "during": False, "isig": True, "after": True}


def test_a_background_job_leaves_the_terminal_alone_and_is_not_stopped():
    # `chatcli once ... &`: setting the terminal's modes from a background job would stop
    # it with SIGTTOU.
    report = _in_a_terminal(
        """
        import os, sys, termios
        from chatcli.terminal.keyboard import quiet_keyboard
        child = os.fork()
        if child == 0:
            os.setpgid(0, 0)  # a job of its own, not the terminal's foreground one
            with quiet_keyboard():
                pass
            os._exit(0)
        _, status = os.waitpid(child, os.WUNTRACED)
        report["stopped"] = os.WIFSTOPPED(status)
        if report["stopped"]:
            os.kill(child, 9)
        report["echo"] = bool(termios.tcgetattr(sys.stdin.fileno())[3] & termios.ECHO)
        """
    )
    assert report == {"stopped": False, "echo": True}


def test_without_a_terminal_the_keyboard_is_left_alone(tmp_path):
    with (tmp_path / "f").open("w+") as not_a_terminal, quiet_keyboard(not_a_terminal):
        pass


def test_a_ctrl_c_while_the_turn_closes_is_let_go_and_the_handler_comes_back():
    # In a process of its own: a real SIGINT that got through would end the test run.
    script = """
        import os, signal, time
        from chatcli.terminal.keyboard import interrupts_held
        before = signal.getsignal(signal.SIGINT)
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            print("closed")  # reached: the Ctrl-C did not cut the closing short
        assert signal.getsignal(signal.SIGINT) is before
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            print("interrupted after")
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split("\n")[:2] == ["closed", "interrupted after"], done.stderr
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_deferred_ctrl_c_comes_after_the_block_and_a_held_one_not_at_all():
    script = """
        import os, signal, time
        from chatcli.terminal.keyboard import interrupts_deferred, interrupts_held
        try:
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
                print("drawn whole")
        except KeyboardInterrupt:
            print("then stopped")
        with interrupts_held(), interrupts_deferred():  # closing a turn: let go, not raised
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        print("closed")
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split("\n")[:3] == ["drawn whole", "then stopped", "closed"], done.stderr
