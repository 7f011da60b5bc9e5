"""The head-pod seam (e2e/pods/head.py) on this machine's one network namespace."""

import socket

from e2e.pods.head import host_network_ports
from rlhf_api import contract


def test_each_head_gets_a_metrics_port_of_its_own_where_the_rendered_one_is_taken():
    """Two heads at once (two of the suite's workers) were both given the trainer's fixed port: the
    second trainer died with `Address already in use`."""
    with socket.create_server(("", 0)) as taken:  # the port the other head's trainer holds
        rendered = {contract.METRICS_PORT_ENV: str(taken.getsockname()[1])}
        ports = {int(host_network_ports(rendered)[contract.METRICS_PORT_ENV]) for _ in range(3)}
        assert taken.getsockname()[1] not in ports
        for port in ports:
            socket.create_server(("", port)).close()  # each free to bind
    assert host_network_ports({}) == {}
