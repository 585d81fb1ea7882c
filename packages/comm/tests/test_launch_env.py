"""Launch detection from each launcher's variables (simulated environments)."""

from __future__ import annotations

import pytest

from capstan.comm import LaunchError, detect_launch


def test_single_process_when_nothing_is_set() -> None:
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("single", 0, 1, 0, 1)


def test_openmpi_variables() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    info = detect_launch(env)
    got = (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size)
    assert got == ("openmpi", 5, 8, 1, 4)
    assert info.describe("world_size") == "world size 8 from OMPI_COMM_WORLD_SIZE"
    assert info.is_mpi and info.master_addr is None


def test_mpich_hydra_variables() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("mpich", 2, 4, 0, 2)
    assert info.source("rank") == "PMI_RANK"


def test_torchrun_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    info = detect_launch(env)
    got = (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size)
    assert got == ("torchrun", 3, 4, 1, 2)
    assert (info.master_addr, info.master_port) == ("10.1.2.3", 29500)


def test_torchrun_takes_precedence_over_an_enclosing_slurm_allocation() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_launch(env).launcher == "torchrun"


@pytest.mark.parametrize(
    ("tasks_per_node", "node", "local_world"),
    [("4", "0", 4), ("2(x3)", "2", 2), ("4,2(x2)", "2", 2), ("3,1", "1", 1)],
)
def test_slurm_variables(tasks_per_node: str, node: str, local_world: int) -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": tasks_per_node,
           "SLURM_NODEID": node, "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7", "SLURM_JOB_ID": "12345"}
    info = detect_launch(env)
    assert (info.launcher, info.world_size, info.local_world_size) == ("slurm", 8, local_world)
    assert info.master_addr == "10.0.0.7" and info.source("master_addr") == "SLURM_LAUNCH_NODE_IPADDR"
    assert info.master_port == 20000 + 12345 % 20000


def test_harness_file_rendezvous() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "CAPSTAN_RENDEZVOUS_FILE": "/tmp/x"}
    info = detect_launch(env)
    assert info.launcher == "harness" and info.rendezvous_file == "/tmp/x"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
         r"rank 4 from OMPI_COMM_WORLD_RANK is outside 0..3 \(world size 4 from OMPI_COMM_WORLD_SIZE\)"),
        ({"PMI_RANK": "x", "PMI_SIZE": "4"}, r"PMI_RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"world size 0 from WORLD_SIZE must be at least 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, r"local world size 3 from LOCAL_WORLD_SIZE"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, r"rank not found: none of OMPI_COMM_WORLD_RANK is set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, r"master port 70000 from MASTER_PORT"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(y)"}, r"cannot parse SLURM_TASKS"),
    ],
)
def test_inconsistent_environments_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        detect_launch(env)


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, None),
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, 3),
        ({"RANK": "1", "WORLD_SIZE": "2"}, 1),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, 2),
        ({"RANK": "5"}, 5),  # a lone RANK: no launcher detect_launch knows, but still a rank
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, 4),  # inconsistent: never raises
        ({"PMI_RANK": "x", "PMI_SIZE": "4"}, None),
    ],
)
def test_env_rank_never_raises(env: dict[str, str], rank: int | None) -> None:
    from capstan.comm.job.launch_env import env_rank

    assert env_rank(env) == rank
