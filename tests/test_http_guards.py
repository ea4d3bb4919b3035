import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")

from chatcli.serve.guards import LOOPBACK_HOSTNAMES, hostname_of, hosts_to_check, media_type


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("localhost:8000", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("LocalHost", "localhost"),
        ("[::1]x", "[::1]x"),
        ("evil.example:80", "evil.example"),
    ],
)
def test_the_hostname_is_read_without_its_port_ipv6_included(host, name):
    assert hostname_of(host) == name


def test_only_a_loopback_server_checks_host_names():
    assert hosts_to_check("127.0.0.1") == LOOPBACK_HOSTNAMES
    assert hosts_to_check("::1") == LOOPBACK_HOSTNAMES
    assert hosts_to_check("localhost") == LOOPBACK_HOSTNAMES
    assert hosts_to_check("127.0.0.2") == LOOPBACK_HOSTNAMES | {"127.0.0.2"}
    assert hosts_to_check("0.0.0.0") is None
    assert hosts_to_check("192.168.1.5") is None
    assert hosts_to_check("::") is None


def test_a_media_type_is_read_without_its_parameters():
    assert media_type("Application/JSON; charset=utf-8") == "application/json"
    assert media_type("") == ""
