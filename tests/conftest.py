from datetime import timedelta

import pytest
import torch

# torch.optim imports torch._dynamo when the first optimizer is built (~0.8 s of CPU). Imported
# once here, it is inherited by every rank the harness forks, which would each import it again
# (as plait's launcher preloads it into its forkserver): the dist tests took 40% longer.
import torch._dynamo  # noqa: F401, E402
import torch.distributed as dist

# One intra-op thread in the test process and, through fork, in every worker it starts: the
# machine has 2 cores, and oversubscribed ranks are many times slower.
torch.set_num_threads(1)


# What a test measures and prints (never asserts: a timing, a rate) is said at the end of the run,
# in a section of its own, whatever runs the test (a pytest-xdist worker's own output is lost).
@pytest.fixture
def say(request):
    """`say(line)`: print `line` in the run's summary, under the heading "measured"."""
    return lambda line: request.node.user_properties.append(("said", line))


def pytest_terminal_summary(terminalreporter):
    said = [value for report in terminalreporter.stats.get("passed", [])
            for key, value in report.user_properties if key == "said"]
    if said:
        terminalreporter.section("measured")
        for line in said:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def nccl_world_of_one():
    """A process group of this process alone over NCCL, for the tests that need a CUDA device."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()
