"""The gen worker's receivers get their data plane through the one factory (one
data-plane seam): ``UcxReceiverFactory`` builds the real KVReceiver, whose plane is the one
``TransceiverConfig.backend`` picks, so a fake-backend gen rank imports no ucxx at all, and a
ucxx-backend rank still binds UCX to its interface on the route to the ctx workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helixserve.config_transceiver import TransceiverConfig
from helixserve.gen_server.kv_source import UcxReceiverFactory
from helixserve.parallel.mapping import Mapping
from helixserve.transceiver.ucxx_backend.devices import local_address_toward, net_devices_for, ucx_net_devices
from tests.unit.transceiver_harness import LAYOUT

ROOT = Path(__file__).resolve().parents[2]

FAKE_RANK = """
import json, sys
import torch
from helixserve.gen_server.kv_source import UcxReceiverFactory
from helixserve.parallel.mapping import Mapping
from helixserve.config_transceiver import TransceiverConfig
from tests.unit.transceiver_harness import LAYOUT

factory = UcxReceiverFactory(TransceiverConfig(backend="fake", kv_transfer_timeout_ms=5000), LAYOUT, ctx_hosts=("127.0.0.1",))
paced = factory(Mapping(world_size=2, rank=1, cp=2), torch.device("cpu"))
plane = type(paced.receiver.plane).__module__ + "." + type(paced.receiver.plane).__name__
paced.close()
print(json.dumps({"plane": plane, "cp_rank": paced.receiver.cp_rank,
                  "ucx": sorted(m for m in sys.modules if m.split(".")[0] == "ucxx" or "ucxx_backend" in m)}))
"""


def test_a_fake_backend_gen_rank_imports_no_ucxx():
    out = subprocess.run([sys.executable, "-c", FAKE_RANK], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"plane": "helixserve.transceiver.fake.FakeDataPlane", "cp_rank": 1, "ucx": []}


def test_a_ucxx_gen_rank_binds_toward_the_ctx_hosts():
    """The real UCX context of the factory's receiver has the devices of this machine's interface
    toward the ctx hosts (loopback here), as when kv_source resolved them itself."""
    factory = UcxReceiverFactory(TransceiverConfig(backend="ucxx", kv_transfer_timeout_ms=5000), LAYOUT, ctx_hosts=("127.0.0.1",))
    paced = factory(Mapping(world_size=1), torch.device("cpu"))
    try:
        assert paced.receiver.plane._context.config["NET_DEVICES"] == net_devices_for("127.0.0.1")
        assert net_devices_for("127.0.0.1").split(",")[0] == "lo"
    finally:
        paced.close()


@pytest.mark.parametrize(("configured", "host", "peers", "expected"), [
    ("all", None, ("127.0.0.1",), None),  # UCX's default: every device
    ("eth7,mlx5_0:1", None, ("127.0.0.1",), "eth7,mlx5_0:1"),  # as configured
    (None, "127.0.0.1", ("no-such-host.invalid",), "host"),  # a sender: where it serves
    (None, None, ("no-such-host.invalid", "127.0.0.1"), "peer"),  # a receiver: toward the first resolvable peer
    (None, None, (), None),  # nothing known: UCX's default
])
def test_ucx_net_devices_resolution(configured, host, peers, expected):
    lo = net_devices_for("127.0.0.1")
    want = {"host": lo, "peer": net_devices_for(local_address_toward(peers))}.get(expected, expected)
    assert ucx_net_devices(configured, host, peers) == want
    if expected in ("host", "peer"):
        assert want is not None and want.split(",")[0] == "lo"
