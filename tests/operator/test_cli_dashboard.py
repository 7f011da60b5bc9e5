"""`rlhf dashboard`'s local side: Ctrl-C stops it wherever the kernel delivers the signal. (Its port-forward to a
head pod through a real API server: e2e/test_dev_cluster.py.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

# A forwarding thread that takes the SIGINT itself, as the kernel may hand it a process's signal, once the main
# thread, which alone runs Python's handler, waits for the next connection (its kernel wait channel: not a lock's
# futex, as for the GIL); the main thread must wake and stop.
SERVE = textwrap.dedent("""
    import signal, socket, threading, time
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
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        local.recv(1)  # a forward waiting on its connection

    try:
        accept_until_interrupted(server, forward)
    except KeyboardInterrupt:
        print("stopped", flush=True)
""")


def test_ctrl_c_delivered_to_a_forwarding_thread_stops_the_dashboard():
    serving = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(serving.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)):
            out, err = serving.communicate(timeout=60)  # a main thread left in accept() never ends
    finally:
        serving.kill()
    assert (serving.returncode, out) == (0, "stopped\n"), err
