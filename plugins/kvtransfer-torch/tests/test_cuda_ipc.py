"""cuda_ipc KV transfer: refused off CUDA with the accepted backends named; the handshake refuses
a decode server on another machine; on a GPU, another process opens a shared tensor's memory and
copies it bit for bit (the path a decode server takes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from engine_kvtransfer_torch.ipc import CudaIpcKvTransfer, host_id, share

from engine.disaggregation.transfer import KvLayout, KvTransferContext

_LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=4, v_head_dim=4, dtype="torch.bfloat16")


def test_refused_for_a_cpu_pool_naming_what_is_accepted() -> None:
    ctx = KvTransferContext(role="decode", layout=_LAYOUT, device="cpu")
    with pytest.raises(ValueError, match="needs a CUDA KV pool.*accepted here: zmq, torch"):
        CudaIpcKvTransfer(ctx)


def test_handshake_refuses_a_decode_server_on_another_machine() -> None:
    backend = CudaIpcKvTransfer.__new__(CudaIpcKvTransfer)  # the check alone: no sockets, no GPU
    backend._host = host_id()
    assert backend._refusal({"ipc_host": host_id()}) is None
    why = backend._refusal({"ipc_host": "elsewhere/0"})
    assert why is not None and "one machine only" in why and "torch or zmq" in why
    assert backend._refusal({}) is not None  # a decode server of another backend


_CHILD = textwrap.dedent("""
    import json, sys, torch
    from engine_kvtransfer_torch.ipc import open_shared
    desc = json.loads(sys.stdin.read())
    t = open_shared(desc, torch.bfloat16, desc["shape"])
    print(json.dumps({"sum": float(t.float().sum()), "first": t.flatten()[:5].float().tolist(),
                      "device": str(t.device)}))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_another_process_reads_a_shared_tensor() -> None:
    base = torch.randn(3, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    view = base[1:]  # a view at an offset in its storage, as a stacked payload may be
    out = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(share(view)), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] == view.flatten()[:5].float().tolist()
    assert got["sum"] == pytest.approx(float(view.float().sum()), rel=1e-6)
    assert got["device"] == str(view.device)
