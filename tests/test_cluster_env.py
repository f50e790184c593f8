"""``elmo-jax train`` under a cluster's launcher (``srun``, ``mpirun``): what the multi-host flags
leave unset comes from the job's environment (``multihost.from_cluster``). The launch itself, two
processes from a SLURM job step's variables, is ``test_distributed.py::test_multihost_cli_equals_single_process``."""

from __future__ import annotations

import argparse

import pytest

from elmo_jax.cli import multihost

SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
CLUSTER_ENV = [*SLURM_STEP, "SLURM_PROCID", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "OMPI_MCA_orte_hnp_uri"]
CLUSTER_ENV += ["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"]


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        pytest.param({"coordinator": "node01:1234"}, {"SLURM_PROCID": "1"}, ("node01:1234", 2, 1), id="ids"),
        pytest.param({}, {"SLURM_PROCID": "1", "JAX_COORDINATOR_PORT": "999"}, ("node01:999", 2, 1), id="srun"),
        pytest.param({"process_id": 0}, {"SLURM_PROCID": "1"}, ("node01:61447", 2, 0), id="a-flag-wins"),
        pytest.param({}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (None, None, None), id="one-task"),
        pytest.param({"num_processes": 1}, {"SLURM_PROCID": "1"}, (None, 1, None), id="num-processes-1"),
    ],
)
def test_what_the_flags_leave_unset_comes_from_the_clusters_environment(monkeypatch, flags, env, expected):
    """What ``jax.distributed.initialize()`` would find in a SLURM job step fills what the flags
    leave unset, before jax starts, so that process 0 knows it is process 0 (``_keep_service``):
    the ids, and under ``srun`` the coordinator (the first node, at JAX_COORDINATOR_PORT or a
    port made of the job id, as jax makes it). One task, or ``--num-processes 1``, is a run of one."""
    for name in CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in (SLURM_STEP | env).items():
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(coordinator=None, num_processes=None, process_id=None, init_timeout=5)
    vars(args).update(flags)
    said = multihost.from_cluster(args)
    assert (args.coordinator, args.num_processes, args.process_id) == expected
    if expected[0] is None:
        assert said is None
    else:
        assert said == f"process {expected[2]} of 2, from SLURM's environment (coordinator {expected[0]})"


def test_without_a_cluster_the_flags_are_left_as_they_are(monkeypatch):
    for name in CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(coordinator="h:1", num_processes=None, process_id=None, init_timeout=5)
    assert multihost.from_cluster(args) is None
    assert (args.coordinator, args.num_processes, args.process_id) == ("h:1", None, None)


def test_an_open_mpi_launch_is_read_as_jax_reads_it(monkeypatch):
    """``mpirun -n 3 elmo-jax train ...``: the coordinator is the launcher's host, at a port made of
    the job id, as jax makes it."""
    for name in CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    args = argparse.Namespace(coordinator=None, num_processes=None, process_id=None, init_timeout=5)
    said = multihost.from_cluster(args)
    assert (args.coordinator, args.num_processes, args.process_id) == ("10.96.0.1:62624", 3, 2)
    assert said == "process 2 of 3, from Open MPI's environment (coordinator 10.96.0.1:62624)"
