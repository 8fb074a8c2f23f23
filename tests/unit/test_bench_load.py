"""`plait.bench.load.OtherLoad`: the CPU time other processes used while a bench row ran, from
/proc; the bench's own processes (this one and its descendants) are not counted."""

import os
import subprocess
import sys
import time

from plait.bench.load import OtherLoad

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 2: pass\n"


def test_a_busy_process_elsewhere_counts_and_a_busy_worker_of_ours_does_not():
    cores = os.cpu_count() or 1
    with OtherLoad() as ours:  # a child of this process: the bench's own work
        subprocess.run([sys.executable, "-c", BUSY], check=True)
    with OtherLoad() as theirs:  # orphaned at once (its shell exits): another job's
        subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{BUSY}" > /dev/null &'], check=True)
        time.sleep(2.5)
    # One busy process is one core's worth, 1 / cores of the machine: counted when it is
    # another's, not when it is ours (compared with each other, so that whatever else runs
    # on the machine meanwhile shows in both).
    assert theirs.share - ours.share > 0.6 / cores, (theirs.share, ours.share)
