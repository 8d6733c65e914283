"""Step inputs and next ids between host and device (florist/engine/staging.py): the copies go
through the CUDA driver where it loads, through torch elsewhere, with the same results."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from florist.engine import staging

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_staging_uses_the_packed_inputs_in_place():
    s = staging.InputStaging(torch.device("cpu"))
    s.buffer(5)[:] = np.arange(5)
    assert s.send().tolist() == [0, 1, 2, 3, 4]
    pending = staging.TokenReadback(torch.device("cpu")).start(torch.tensor([7, 8, 9]), 2)
    assert pending.ready() and pending.tolist() == [7, 8]


def test_raw_copies_switch_off_from_the_environment():
    script = "from florist.engine import staging; print(staging.RAW_COPIES, staging._driver())"
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "FLORIST_RAW_COPIES": "0", "PYTHONPATH": str(ROOT)},
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "None"]


class _FakeEvent:
    """A torch.cuda.Event's surface: the handle (0 until torch's first record creates it)."""

    def __init__(self, handle: int):
        self.cuda_event, self.torch_records = handle, 0

    def record(self):
        self.torch_records += 1
        self.cuda_event = self.cuda_event or 99


class _FakeDriver:
    """The driver calls on CPU tensors: a copy is a memmove of the bytes, or turned down."""

    def __init__(self, refuse_copies: bool = False, refuse_records: bool = False):
        self.refuse_copies, self.refuse_records = refuse_copies, refuse_records
        self.calls = []

    def stream(self, index):
        return 1234

    def _copy(self, dst, src, nbytes, stream):
        self.calls.append(("copy", stream))
        if self.refuse_copies:
            return 201  # CUDA_ERROR_INVALID_CONTEXT
        ctypes.memmove(dst, src, nbytes)
        return 0

    htod = dtoh = _copy

    def record(self, handle, stream):
        self.calls.append(("record", handle, stream))
        return 1 if self.refuse_records else 0


@pytest.mark.parametrize("to_device", [True, False])
@pytest.mark.parametrize("refuse_copies, refuse_records, handle", [(False, False, 7), (False, False, 0), (True, False, 7), (False, True, 7)])
def test_the_driver_path_and_its_fallbacks(monkeypatch, to_device, refuse_copies, refuse_records, handle):
    """Copies the driver takes are queued on the current stream with the event after them
    (through torch while the event has no handle yet, or if the driver refuses the record); a
    copy the driver turns down goes through torch's calls instead. The bytes land either way."""
    driver = _FakeDriver(refuse_copies, refuse_records)
    monkeypatch.setattr(staging, "_driver", lambda: driver)
    src, dst, event = torch.arange(9, dtype=torch.int32), torch.zeros(9, dtype=torch.int32), _FakeEvent(handle)
    (staging.copy_to_device if to_device else staging.copy_to_host)(dst, src, event)
    assert torch.equal(dst, src)
    if refuse_copies:
        assert driver.calls == [("copy", 1234)] and event.torch_records == 1
    elif handle == 0:
        assert driver.calls == [("copy", 1234)] and event.torch_records == 1
    else:
        assert driver.calls == [("copy", 1234), ("record", handle, 1234)] and event.torch_records == (1 if refuse_records else 0)


def _stall(seconds: float) -> None:
    torch.cuda._sleep(int(seconds * 2e9))


@pytest.mark.gpu
@pytest.mark.parametrize("raw", [True, False])
def test_copies_queue_on_the_current_stream_and_carry_the_bytes(raw, monkeypatch):
    """Odd sizes both ways; each copy and its event wait behind work already queued on the
    current stream (a side stream here), and the event passes once the copy has landed."""
    if not raw:
        monkeypatch.setattr(staging, "_driver", lambda: None)
    elif staging._driver() is None:
        pytest.fail("the CUDA driver library did not load on a CUDA machine")
    rng = np.random.default_rng(0)
    side = torch.cuda.Stream()
    # One of each for all sizes: from the second copy on, each records an event that exists
    # (the first record of a torch event creates it, through torch).
    s = staging.InputStaging(torch.device("cuda"), ring=1)
    readback = staging.TokenReadback(torch.device("cuda"))
    for n in (1, 7, 333, 4099, 2, 5):
        values = rng.integers(-2**31, 2**31 - 1, size=n, dtype=np.int64).astype(np.int32)
        # Allocate first: a first pinned or device allocation may wait for the device itself.
        s.buffer(n)[:] = values
        dev = torch.full((n,), -1, dtype=torch.int32, device="cuda")
        ids = torch.from_numpy(values.astype(np.int64)).cuda()
        for _ in range(readback.RING):
            readback.start(ids, n).tolist()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            _stall(0.05)
            s.send(out=dev)
            event = s._copied[s._slot]
            assert not event.query(), f"{n} ids: the copy ran ahead of the stream's queued work"
            pending = readback.start(ids, n)
            assert not pending.ready(), f"{n} ids: the read-back ran ahead of the stream's queued work"
        side.synchronize()
        assert event.query()
        np.testing.assert_array_equal(dev.cpu().numpy(), values)
        assert pending.tolist() == values.tolist()


@pytest.mark.gpu
def test_copy_to_host_of_a_strided_tensor_goes_through_torch():
    src = torch.arange(20, dtype=torch.float32, device="cuda").view(4, 5)[:, 1:4]
    dst = torch.empty((4, 3), dtype=torch.float32, pin_memory=True)
    event = torch.cuda.Event()
    staging.copy_to_host(dst, src, event)
    event.synchronize()
    assert torch.equal(dst, src.cpu())


@pytest.mark.gpu
def test_a_thread_whose_first_cuda_call_is_a_copy():
    """A new thread has no CUDA context current until its first runtime call; the driver turns a
    copy down there, and torch's call (which makes the context current) runs it instead."""
    import threading

    values = np.arange(11, dtype=np.int32)
    got = {}

    def work():
        try:
            s = staging.InputStaging(torch.device("cuda"), ring=1)
            s.buffer(11)[:] = values
            dst = torch.empty(11, dtype=torch.int32, device="cuda")
            s.send(out=dst)
            s.buffer(11)[:] = values + 1  # waits for the first copy, then copies through the driver
            s.send(out=dst)
            got["rows"] = dst.cpu().numpy()
        except BaseException as e:  # reported below, on the test's thread
            got["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in got, got.get("error")
    np.testing.assert_array_equal(got["rows"], values + 1)
