"""`rlhf dashboard`'s local side: Ctrl-C stops it however the SIGINT comes. (Its port-forward to a head pod
through a real API server: e2e/test_dev_cluster.py.)"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap

import pytest

# Once the main thread, which alone runs Python's handlers, waits for the next connection (its kernel wait
# channel: not a lock's futex, as for the GIL), a forwarding thread sends the SIGINT: to itself, as the kernel
# may hand a process's signal to any of its threads, or to the process. The main thread must wake and stop.
SERVE = textwrap.dedent("""
    import os, signal, socket, sys, threading, time
    from rlhf_cli.dashboard import accept_until_interrupted

    server = socket.create_server(("127.0.0.1", 0))
    main = threading.get_native_id()
    print(server.getsockname()[1], flush=True)

    def waiting(thread):
        with open(f"/proc/self/task/{thread}/wchan") as wchan:
            where = wchan.read()
        return where not in ("", "0") and "futex" not in where

    def forward(local):
        for _ in range(1000):  # a kernel that names no wait channel: after 10 s, as it is
            if waiting(main):
                break
            time.sleep(0.01)
        if sys.argv[1] == "thread":
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        else:
            os.kill(os.getpid(), signal.SIGINT)
        local.recv(1)  # a forward waiting on its connection

    try:
        accept_until_interrupted(server, forward)
    except KeyboardInterrupt:
        print("stopped", flush=True)
""")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("target, started_with", [
    ("thread", None),  # a forwarding thread takes the signal
    ("process", _ignore_sigint),  # started as a script's background job is: SIGINT ignored, which Python keeps
], ids=["to-a-forwarding-thread", "sigint-ignored-at-start"])
def test_ctrl_c_stops_the_dashboard(target, started_with):
    serving = subprocess.Popen([sys.executable, "-c", SERVE, target], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=started_with)
    try:
        port = int(serving.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)):
            out, err = serving.communicate(timeout=60)  # a main thread that never wakes never ends
    finally:
        serving.kill()
    assert (serving.returncode, out) == (0, "stopped\n"), err
