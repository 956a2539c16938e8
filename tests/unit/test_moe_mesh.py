"""Expert groups on the device mesh (issue 32): the EP / EDP rank arithmetic splits the data dimension
(DeepSpeed's layout), and expert parallelism with tensor or sequence parallelism is refused naming the key."""

from __future__ import annotations

import pytest

from dscore.errors import ConfigError
from dscore.moe.groups import ExpertTopology
from dscore.parallel.mesh import MeshShape, ParallelMesh


def test_expert_groups_of_a_data_only_mesh_are_deepspeeds_layout() -> None:
    shape = MeshShape.of(8)
    topo = ExpertTopology(8, 2)
    for rank in range(8):
        assert shape.ep_ranks(rank, 2) == next(g for g in topo.ep_groups if rank in g)
        assert shape.edp_ranks(rank, 2) == next(g for g in topo.edp_groups if rank in g)
    assert shape.ep_ranks(5, 4) == [4, 5, 6, 7]
    assert shape.edp_ranks(5, 4) == [1, 5]
    with pytest.raises(ConfigError, match="ep_size=3 must be >= 1 and divide"):
        shape.ep_ranks(0, 3)


def test_expert_groups_split_the_data_dimension_at_fixed_tensor_and_sequence_index() -> None:
    shape = MeshShape.of(16, tp=2, sp=2)  # dp 4
    assert shape.dp_ranks(5) == [1, 5, 9, 13]
    assert shape.ep_ranks(5, 2) == [1, 5]
    assert shape.ep_ranks(9, 2) == [9, 13]
    assert shape.edp_ranks(5, 2) == [5, 13]  # dp index 1: the second expert of each block


@pytest.mark.parametrize(("tp", "sp", "key"), [(2, 1, "tensor_parallel.autotp_size"), (1, 2, "sequence_parallel_size")])
def test_expert_parallelism_with_tensor_or_sequence_parallelism_is_refused(tp: int, sp: int, key: str) -> None:
    mesh = ParallelMesh(MeshShape.of(4, tp=tp, sp=sp), 0, None, None, None, None)
    with pytest.raises(ConfigError, match=f"MoE expert parallelism .* with {key} = 2 is not implemented") as info:
        mesh.expert_groups(2)
    assert info.value.path == key


def test_expert_accessors_never_create_groups() -> None:
    from dscore.errors import DscoreError

    mesh = ParallelMesh(MeshShape.of(1), 0, None, None, None, None)
    with pytest.raises(DscoreError, match="no expert-parallel groups named 'ep_size_2' on this mesh .built: none."):
        mesh.created_expert_groups("ep_size_2")
