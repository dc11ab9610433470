"""Launcher detection and the multi-process helpers."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import ep_comm
from conftest import _INFO

pytestmark = [pytest.mark.multiprocess, pytest.mark.processes]  # the file is about processes


@pytest.mark.parametrize("env,want", [
    ({}, ("single", 0, 1)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, ("openmpi", 3, 4)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, ("mpich", 1, 2)),
])
def test_launch_info(env, want):
    info = ep_comm.distributed.launch_info(env)
    assert (info.launcher, info.process_id, info.num_processes) == want


def test_launch_info_rejects_inconsistent_env():
    with pytest.raises(RuntimeError, match=re.escape(
            "ep_comm.distributed: OMPI_COMM_WORLD_RANK=4 is not in [0, OMPI_COMM_WORLD_SIZE=4)")):
        ep_comm.distributed.launch_info({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"})


def test_initialize_validates_device_count():
    with pytest.raises(ValueError, match=re.escape(
            "initialize: local_device_count must be a positive int, got 0")):
        ep_comm.distributed.initialize(local_device_count=0)


def test_cluster_matches_launch():
    assert jax.process_count() == _INFO.num_processes
    assert jax.process_index() == _INFO.process_id


def test_global_array_round_trip(sharded, n, rng):
    a = rng.standard_normal((n * 3, 2)).astype(np.float32)
    np.testing.assert_array_equal(sharded.get(sharded.put(a)), a)
