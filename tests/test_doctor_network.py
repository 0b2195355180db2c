"""The doctor's interface is the control plane's: HVPS_CONTROL_ADDR wins there as it does in
hvps.control.plane.candidate_addresses, and a recorded node replays the same rule."""

from __future__ import annotations

import json
import os

import pytest

from hvps.control.plane import candidate_addresses, listen_address
from hvps.doctor import Host
from hvps.doctor.checks_network import control_interface
from hvps.doctor.host import FACTS_FILE, replay_control_rule

pytestmark = pytest.mark.unit

ADDRESSES = {"eth0": "10.0.0.1", "ib0": "10.1.0.1", "lo": "127.0.0.1"}


def tree(tmp_path, env, addresses=ADDRESSES, **facts) -> Host:
    (tmp_path / FACTS_FILE).write_text(json.dumps(dict(facts, env=env, addresses=addresses)))
    return Host(str(tmp_path))


@pytest.mark.parametrize("env,expected", [
    ({}, ("eth0", "10.0.0.1", "first non-loopback address (control plane's rule)")),
    ({"HVPS_NETWORK_INTERFACE": "ib0"}, ("ib0", "10.1.0.1", "HVPS_NETWORK_INTERFACE")),
    ({"HVPS_NETWORK_INTERFACE": "ib9"}, ("ib9", None, "HVPS_NETWORK_INTERFACE")),
    ({"HVPS_CONTROL_ADDR": "10.1.0.1"}, ("ib0", "10.1.0.1", "HVPS_CONTROL_ADDR")),
    ({"HVPS_CONTROL_ADDR": "10.1.0.1", "HVPS_NETWORK_INTERFACE": "eth0"}, ("ib0", "10.1.0.1", "HVPS_CONTROL_ADDR")),
    ({"HVPS_CONTROL_ADDR": "192.0.2.7"}, (None, "192.0.2.7", "HVPS_CONTROL_ADDR")),
])
def test_recorded_node_follows_the_control_planes_rule(tmp_path, env, expected):
    assert control_interface(tree(tmp_path, env)) == expected


def test_a_recorded_answer_of_the_control_plane_wins(tmp_path):
    host = tree(tmp_path, {}, control={"addresses": ["10.1.0.1", "10.0.0.1"], "listen": ""})
    assert control_interface(host)[:2] == ("ib0", "10.1.0.1")


@pytest.mark.parametrize("env", [
    {},
    {"HVPS_NETWORK_INTERFACE": "lo"},
    {"HVPS_CONTROL_ADDR": "192.0.2.7"},
    {"HVPS_CONTROL_ADDR": "192.0.2.7", "HVPS_NETWORK_INTERFACE": "lo"},
    {"HVPS_NETWORK_INTERFACE": "nosuch0"},
])
def test_this_machine_the_doctor_asks_the_control_plane(monkeypatch, env):
    """On the real machine the doctor's answer is candidate_addresses()/listen_address()'s, and the
    replay of a recorded node gives the same on this machine's facts."""
    for name in ("HVPS_CONTROL_ADDR", "HVPS_NETWORK_INTERFACE", "HOROVOD_GLOO_IFACE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    host = Host("/")
    answer = host.control_addresses()
    replayed = replay_control_rule(os.environ, host.interface_addresses())
    if "error" in answer:
        assert "error" in replayed and env.get("HVPS_NETWORK_INTERFACE") == "nosuch0"
        assert control_interface(host) == ("nosuch0", None, "HVPS_NETWORK_INTERFACE")
        return
    assert answer == {"addresses": candidate_addresses(), "listen": listen_address()} == replayed
    name, addr, how = control_interface(host)
    assert addr == candidate_addresses()[0]
    if "HVPS_CONTROL_ADDR" in env:
        assert (name, addr, how) == (None, "192.0.2.7", "HVPS_CONTROL_ADDR")
