"""A worker's welcome comes over the network: a rank or shard ranges that do not fit the job
end the worker with one clear line (LinkError) rather than a traceback or a wrong seat."""

import pytest

from omnips.job import JobSpec
from omnips.link import LinkError
from omnips.worker.service import _check_seat

JOB = JobSpec(num_workers=2, num_servers=2)


def cluster(ranges, num_params=10):
    return {"ranges": ranges, "num_params": num_params}


def test_the_schedulers_own_seat_is_taken():
    for rank in (0, 1):
        _check_seat(rank, JOB, cluster([[0, 5], [5, 10]]))


@pytest.mark.parametrize("rank", [-1, 2, 2 ** 63])
def test_a_rank_outside_the_job_is_refused(rank):
    with pytest.raises(LinkError, match=rf"malformed welcome from the scheduler: rank {rank} in a job of 2 workers"):
        _check_seat(rank, JOB, cluster([[0, 5], [5, 10]]))


@pytest.mark.parametrize("ranges", [[[0, 5]], [[5, 10], [0, 5]], [[0, 4], [4, 10]], [[None, 5], [5, 10]],
                                    [[0, 5], [5, 10 ** 12]], [[0, 5], [5, 10], [10, 10]], "x" * 10_000])
def test_ranges_that_are_not_the_jobs_shards_are_refused(ranges):
    with pytest.raises(LinkError, match="malformed welcome from the scheduler: shard ranges .* are not 10 values "
                                        "over 2 servers") as exc:
        _check_seat(0, JOB, cluster(ranges))
    assert len(str(exc.value)) < 300  # the line does not repeat what was sent
