"""The endpoint pool: sticky per instance, least-loaded for new instances, failing endpoints out."""

from __future__ import annotations

import pytest

from m3_agent.errors import EndpointError, UsageError
from m3_agent.evals.endpoints import EndpointPool, is_endpoint_failure

A, B, C = "http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"


def test_new_instances_go_to_the_endpoint_with_the_fewest_active_sessions():
    pool = EndpointPool([A, B, C])
    assert [pool.acquire(f"i{n}") for n in range(3)] == [A, B, C]
    pool.release("i1")
    assert pool.acquire("i3") == B  # B has none left, A and C one each
    assert pool.active == {A: 1, B: 1, C: 1}


def test_an_instance_keeps_its_endpoint_across_retries():
    pool = EndpointPool([A, B])
    assert pool.acquire("x") == A
    pool.release("x")
    pool.acquire("y")
    pool.acquire("z")  # A: y, B: z; then x comes back to A though B is as loaded
    assert pool.acquire("x") == A and pool.active[A] == 2
    assert pool.acquire("x") == A and pool.active[A] == 2  # acquiring twice is one session


def test_a_failed_endpoint_is_taken_out_and_its_instances_placed_elsewhere():
    pool = EndpointPool([A, B])
    assert pool.acquire("x") == A
    pool.release("x")
    pool.fail(A, "connection refused")
    assert pool.failed == {A: "connection refused"}
    assert pool.acquire("x") == B and pool.active == {A: 0, B: 1}
    pool.fail(B)
    with pytest.raises(EndpointError, match=r"every endpoint of the pool failed: .*a:8000.*connection refused"):
        pool.acquire("y")


def test_duplicates_are_one_endpoint_and_an_empty_pool_is_a_usage_error():
    assert EndpointPool([A, A + "/", B]).urls == [A, B]
    with pytest.raises(UsageError):
        EndpointPool([])


def test_only_endpoint_errors_count_as_an_endpoint_failure():
    assert is_endpoint_failure("EndpointError: cannot reach the model server at http://a:8000/v1")
    assert not is_endpoint_failure("SandboxUnavailable: no engine")
    assert not is_endpoint_failure(None)


def test_a_pool_or_a_cluster_address_needs_the_ray_executor(tmp_path, capsys, monkeypatch):
    from m3_agent.cli import main

    monkeypatch.chdir(tmp_path)
    for args, message in [
        (["--base-url", A, "--base-url", B], "several --base-url and --ray-address need --executor ray"),
        (["--base-url", A, "--ray-address", "head:6379"], "several --base-url and --ray-address need --executor ray"),
        (["--base-url", A, "--executor", "slurm"], "unknown --executor 'slurm': use local or ray"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "run", "--tasks", "builtin", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err
        assert message in " ".join(err.split()), err
