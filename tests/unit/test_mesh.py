from __future__ import annotations

import pytest
import torch

from torch_dtorch import DeviceMesh, Replicate, Shard
from torch_dtorch.errors import MeshError


def mesh2x3() -> DeviceMesh:
    return DeviceMesh.from_shape("cpu", (2, 3), mesh_dim_names=("dp", "tp"))


def test_basic_properties() -> None:
    m = mesh2x3()
    assert m.shape == (2, 3) and m.ndim == 2 and m.size() == 6
    assert m.size("tp") == 3 and m.size(0) == 2
    assert m.mesh.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert m.devices == [0, 1, 2, 3, 4, 5] and m.first_device == 0
    assert m.coordinate_of(4) == (1, 1)
    assert m.groups("tp") == [[0, 1, 2], [3, 4, 5]]
    assert m.groups("dp") == [[0, 3], [1, 4], [2, 5]]


def test_explicit_ids_and_any_rank() -> None:
    m = DeviceMesh("cuda", torch.tensor([[[4, 5], [6, 7]]]), mesh_dim_names=("a", "b", "c"))
    assert m.shape == (1, 2, 2) and m.first_device == 4 and m.device_type == "cuda"


def test_submesh_is_a_replicated_view() -> None:
    m = mesh2x3()
    tp = m["tp"]
    assert tp.is_submesh and tp.root is m and tp.shape == (3,) and tp.mesh_dim_names == ("tp",)
    assert tp.mesh.tolist() == [0, 1, 2]
    assert tp.devices == m.devices
    assert tp.to_root_placements([Shard(0)]) == (Replicate(), Shard(0))
    assert tp.from_root_placements((Replicate(), Shard(1))) == (Shard(1),)
    assert tp.from_root_placements((Shard(0), Shard(1))) is None
    assert tp.groups("tp") == [[0, 1, 2], [3, 4, 5]]
    both = m[("tp", "dp")]
    assert both.shape == (3, 2) and both.root_axes == (1, 0)
    assert both.to_root_placements([Shard(0), Shard(1)]) == (Shard(1), Shard(0))
    assert m[("dp", "tp")] is m


def test_unbind_into_stages() -> None:
    m = DeviceMesh.from_shape("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    stages = m.unbind("pp")
    assert [s.mesh.tolist() for s in stages] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(s.mesh_dim_names == ("dp", "tp") for s in stages)
    assert stages[1].first_device == 4
    one = DeviceMesh.from_shape("cpu", 3, mesh_dim_names=("pp",)).unbind(0)
    assert [s.mesh.tolist() for s in one] == [[0], [1], [2]] and one[0].mesh_dim_names == ("pp",)


def test_equality_and_hash() -> None:
    a, b = mesh2x3(), mesh2x3()
    assert a == b and hash(a) == hash(b)
    assert a["tp"] == b["tp"] and a["tp"] != a["dp"] and a["tp"] != a
    assert DeviceMesh.from_shape("cpu", (2, 3)) != a  # names differ
    assert DeviceMesh.from_shape("cuda", (2, 3), mesh_dim_names=("dp", "tp")) != a
    assert len({a, b, a["tp"], b["tp"]}) == 2


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DeviceMesh("cpu", [0, 0]), "distinct"),
        (lambda: DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("a",)), "2 axes but got 1"),
        (lambda: DeviceMesh("cpu", [0, 1], mesh_dim_names=("a",))["b"], "no axis named 'b'"),
        (lambda: DeviceMesh("cpu", [0, 1])["a"], "without mesh_dim_names"),
        (lambda: DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("a", "a")), "unique"),
        (lambda: DeviceMesh.from_shape("cpu", (2, 0)), "sizes >= 1"),
        (lambda: DeviceMesh.from_shape("cpu", 2).size(1), "out of range"),
    ],
)
def test_errors(build, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        build()


def test_with_mesh_sets_thread_default() -> None:
    import threading

    from torch_dtorch.mesh import current_mesh

    a, b = mesh2x3(), DeviceMesh.from_shape("cpu", 2)
    assert current_mesh() is None
    with a:
        assert current_mesh() is a
        with b:
            assert current_mesh() is b
            seen: list[object] = []
            t = threading.Thread(target=lambda: seen.append(current_mesh()))
            t.start()
            t.join()
            assert seen == [None]  # per thread
        assert current_mesh() is a
    assert current_mesh() is None
