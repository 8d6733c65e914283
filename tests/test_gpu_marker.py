"""The `gpu` marker (tests/conftest.py): what it skips on which machine, and the skipif it refuses."""

from __future__ import annotations

import pytest
import torch

import conftest


class FakeItem:
    def __init__(self, *marks, nodeid="tests/test_x.py::test_x"):
        self.marks, self.nodeid, self.added = [m.mark for m in marks], nodeid, []

    def iter_markers(self, name=None):
        return (m for m in self.marks if name is None or m.name == name)

    def add_marker(self, marker):
        self.added.append(marker.mark)


@pytest.fixture
def machine(monkeypatch):
    """Pretend this machine has `count` CUDA devices of compute capability `capability`."""

    def set_machine(count: int, capability=(9, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return set_machine


@pytest.mark.parametrize("count,capability,marks,expected", [
    (0, None, [pytest.mark.gpu], "needs CUDA"),
    (0, None, [pytest.mark.gpu(count=2)], "needs CUDA"),
    (1, (9, 0), [pytest.mark.gpu], None),
    (1, (9, 0), [pytest.mark.gpu, pytest.mark.gpu(count=2)], "needs 2 GPUs"),  # module mark + test mark
    (2, (9, 0), [pytest.mark.gpu(count=2)], None),
    (1, (8, 0), [pytest.mark.gpu(capability=(9, 0))], "needs a GPU of compute capability 9.0 or newer"),
    (1, (9, 0), [pytest.mark.gpu(capability=(9, 0))], None),
    (1, (10, 0), [pytest.mark.gpu(capability=(9, 0))], None),
    (0, None, [pytest.mark.slow], None),
])
def test_what_the_marker_skips(machine, count, capability, marks, expected):
    machine(count, capability)
    item = FakeItem(*marks)
    assert conftest._gpu_missing(item) == expected
    conftest.pytest_collection_modifyitems(None, [item])
    assert [m.kwargs["reason"] for m in item.added if m.name == "skip"] == ([expected] if expected else [])


@pytest.mark.parametrize("reason", ["needs CUDA", "needs 2 GPUs", "needs a Hopper GPU"])
def test_a_skipif_for_want_of_a_gpu_stops_the_collection(machine, reason):
    machine(1)
    item = FakeItem(pytest.mark.gpu, pytest.mark.skipif(True, reason=reason), nodeid="tests/test_x.py::test_by_skipif")
    with pytest.raises(pytest.UsageError, match="test_by_skipif"):
        conftest.pytest_collection_modifyitems(None, [item])


def test_other_skipifs_pass(machine):
    machine(0)
    item = FakeItem(pytest.mark.skipif(True, reason="checks the message a machine without CUDA gets"))
    conftest.pytest_collection_modifyitems(None, [item])
    assert item.added == []
