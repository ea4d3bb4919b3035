import os
import pty
import signal
import termios
import time

import pytest

from chatcli.terminal import interrupts_held, quiet_keyboard


def test_echo_is_off_while_a_reply_streams_and_back_after():
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "r", closefd=False) as stream:
            assert termios.tcgetattr(follower)[3] & termios.ECHO
            with quiet_keyboard(stream):
                modes = termios.tcgetattr(follower)[3]
                assert not modes & termios.ECHO and not modes & termios.ECHOCTL
                assert modes & termios.ISIG  # Ctrl-C still stops the reply
                os.write(leader, b"typed ahead\n")
            assert termios.tcgetattr(follower)[3] & termios.ECHO
            # What was typed meanwhile waits for the next prompt, not drawn, not dropped.
            assert stream.readline() == "typed ahead\n"
    finally:
        os.close(leader)
        os.close(follower)


def test_without_a_terminal_the_keyboard_is_left_alone(tmp_path):
    with (tmp_path / "f").open("w+") as not_a_terminal, quiet_keyboard(not_a_terminal):
        pass


def test_a_ctrl_c_while_the_turn_closes_is_let_go_and_the_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    closed = []
    with interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        closed.append("saved")  # reached: the Ctrl-C did not cut the closing short
    assert closed == ["saved"]
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs at once: the sleep is cut short
