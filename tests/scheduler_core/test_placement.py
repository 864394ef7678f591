from __future__ import annotations

from dataclasses import replace

from scheduler.core.hypergraph import Device
from scheduler.core.placement import GroupRequest, GroupShape, PlacementFailure, fits_in, place, relayout


def cluster(nodes: dict[str, tuple[str, int]]) -> list[Device]:
    return [
        Device(id=f"{node}/gpu{i}", node=node, hardware=hw, index=i)
        for node, (hw, count) in nodes.items()
        for i in range(count)
    ]


def test_gang_places_every_group_with_workers_on_one_node() -> None:
    devices = cluster({"a": ("H100", 8), "b": ("H100", 8)})
    result = place(
        [
            GroupRequest("rollout", workers=6, gpus_per_worker=2),
            GroupRequest("actor", workers=1, gpus_per_worker=4),
        ],
        devices,
        devices,
    )
    assert not isinstance(result, PlacementFailure)
    assert len(result["rollout"]) == 6 and len(result["actor"]) == 1
    for workers in result.values():
        for worker in workers:
            assert len({d.node for d in worker}) == 1
    used = [d.id for workers in result.values() for w in workers for d in w]
    assert len(used) == len(set(used)) == 16


def test_all_or_nothing_names_the_group_that_does_not_fit() -> None:
    devices = cluster({"a": ("H100", 8)})
    result = place(
        [
            GroupRequest("rollout", workers=4, gpus_per_worker=1),
            GroupRequest("actor", workers=2, gpus_per_worker=4),
        ],
        devices,
        devices,
    )
    assert isinstance(result, PlacementFailure)
    assert result.group in {"rollout", "actor"}
    assert "free devices" in result.reason


def test_hardware_affinity_is_respected_and_preferred_type_first() -> None:
    devices = cluster({"a": ("H20", 8), "b": ("H800", 8)})
    result = place(
        [
            GroupRequest("actor", workers=2, gpus_per_worker=4, hardware=("H800",)),
            GroupRequest("rollout", workers=4, gpus_per_worker=1, hardware=("H20", "H800")),
        ],
        devices,
        devices,
    )
    assert not isinstance(result, PlacementFailure)
    assert {d.hardware for w in result["actor"] for d in w} == {"H800"}
    assert {d.hardware for w in result["rollout"] for d in w} == {"H20"}


def test_worker_never_spans_nodes_even_when_enough_devices_in_total() -> None:
    devices = cluster({"a": ("H100", 2), "b": ("H100", 2)})
    assert isinstance(place([GroupRequest("actor", 1, 4)], devices, devices), PlacementFailure)


def test_explicit_ranks_use_global_order_and_wait_when_taken() -> None:
    devices = cluster({"b": ("H100", 4), "a": ("H100", 4)})
    result = place([GroupRequest("actor", 0, 2, ranks=(4, 5, 6, 7))], devices, devices)
    assert not isinstance(result, PlacementFailure)
    assert [d.id for w in result["actor"] for d in w] == ["b/gpu0", "b/gpu1", "b/gpu2", "b/gpu3"]

    busy = [d for d in devices if d.id != "b/gpu1"]
    failure = place([GroupRequest("actor", 0, 2, ranks=(4, 5))], busy, devices)
    assert isinstance(failure, PlacementFailure) and "not free" in failure.reason


def test_fits_in_detects_jobs_that_can_never_fit() -> None:
    devices = cluster({"a": ("H100", 8)})
    assert fits_in([GroupRequest("actor", 2, 4)], devices) is None
    failure = fits_in([GroupRequest("actor", 3, 4)], devices)
    assert failure is not None and failure.group == "actor"
    failure = fits_in([GroupRequest("actor", 1, 4, hardware=("H20",))], devices)
    assert failure is not None


def shape(
    name: str,
    split_gpus: int,
    *,
    gpus_per_worker: int = 1,
    max_workers: int | None = None,
    valid_dp: tuple[int, ...] = (),
) -> GroupShape:
    return GroupShape(
        name=name,
        gpus_per_worker=gpus_per_worker,
        min_workers=1,
        max_workers=max_workers,
        valid_dp=valid_dp,
        hardware=(),
        split_gpus=split_gpus,
    )


def test_a_colocated_relayout_gives_every_group_workers_on_all_the_jobs_devices() -> None:
    devices = cluster({"a": ("H100", 4), "b": ("H100", 4)})
    result = relayout([shape("rollout", 6, gpus_per_worker=2), shape("actor", 2)], devices, time_shared=True)
    assert not isinstance(result, PlacementFailure)
    assert len(result["rollout"]) == 4 and len(result["actor"]) == 8
    for workers in result.values():
        assert sorted(d.id for w in workers for d in w) == sorted(d.id for d in devices)
        assert all(len({d.node for d in w}) == 1 for w in workers)


def test_a_disaggregated_relayout_gives_each_group_its_spec_share_and_no_device_twice() -> None:
    devices = cluster({"a": ("H100", 4), "b": ("H100", 4)})
    result = relayout([shape("rollout", 6, gpus_per_worker=2), shape("actor", 2)], devices, time_shared=False)
    assert not isinstance(result, PlacementFailure)
    assert len(result["rollout"]) == 3 and len(result["actor"]) == 2
    used = [d.id for workers in result.values() for w in workers for d in w]
    assert len(used) == len(set(used)) == 8


def test_a_colocated_relayout_keeps_each_group_within_its_limits_on_as_many_devices_as_they_allow() -> None:
    devices = cluster({"a": ("H100", 4), "b": ("H100", 4)})
    capped = relayout([shape("rollout", 4), shape("actor", 4, max_workers=4)], devices, time_shared=True)
    assert not isinstance(capped, PlacementFailure)
    assert len(capped["rollout"]) == 8 and len(capped["actor"]) == 4
    # A trainer whose global batch does not split over 8 ranks time-shares 6 of the 8 GPUs.
    sized = relayout([shape("rollout", 4), shape("actor", 4, valid_dp=(2, 4, 6))], devices, time_shared=True)
    assert not isinstance(sized, PlacementFailure)
    assert len(sized["actor"]) == 6 and all(len({d.node for d in w}) == 1 for w in sized["actor"])
    engines = relayout(
        [shape("rollout", 6, gpus_per_worker=4), shape("actor", 2)],
        cluster({"a": ("H100", 6)}),
        time_shared=True,
    )
    assert not isinstance(engines, PlacementFailure)
    assert len(engines["rollout"]) == 1 and len(engines["actor"]) == 6
    # Whole workers within nodes: two-GPU engines on nodes of 3 and 4 GPUs are three engines.
    odd = relayout(
        [shape("rollout", 4, gpus_per_worker=2), shape("actor", 2)],
        cluster({"a": ("H100", 3), "b": ("H100", 4)}),
        time_shared=True,
    )
    assert not isinstance(odd, PlacementFailure)
    assert len(odd["rollout"]) == 3 and all(len({d.node for d in w}) == 1 for w in odd["rollout"])
    # The reward's and the tools' workers serve calls: they keep their count, time-sharing the
    # first devices, where the stages spread over all of them.
    served = relayout(
        [
            shape("rollout", 5),
            replace(shape("reward", 1), spreads=False),
            replace(shape("tools", 2), spreads=False),
            shape("actor", 2),
        ],
        devices,
        time_shared=True,
    )
    assert not isinstance(served, PlacementFailure)
    assert {group: len(workers) for group, workers in served.items()} == {
        "rollout": 8,
        "reward": 1,
        "tools": 2,
        "actor": 8,
    }


def test_a_relayout_respects_the_operators_limits_and_names_the_group() -> None:
    devices = cluster({"a": ("H100", 4), "b": ("H100", 4)})
    none_fits = relayout([shape("rollout", 4), shape("actor", 4, valid_dp=(16,))], devices, time_shared=True)
    assert none_fits == PlacementFailure("actor", "8 workers is not a valid data-parallel size [16]")
    over = relayout([shape("rollout", 4), shape("actor", 6, max_workers=4)], devices, time_shared=False)
    assert over == PlacementFailure("actor", "6 workers is outside its limits (1–4)")
    uneven = relayout([shape("rollout", 3, gpus_per_worker=2), shape("actor", 2)], devices, time_shared=False)
    assert isinstance(uneven, PlacementFailure) and uneven.group == "rollout"
    # A spec that was colocated has no split of its own to go back to.
    overlapping = relayout([shape("rollout", 8), shape("actor", 8)], devices, time_shared=False)
    assert isinstance(overlapping, PlacementFailure) and "more than the job's 8 GPUs" in overlapping.reason
