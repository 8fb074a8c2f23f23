"""`plait.bench.load.OtherLoad`: the CPU time other processes used while a bench row ran, from
/proc; the bench's own processes (this one and its descendants) are not counted.

Asserted in CPU seconds, not in shares of the machine: a process that burns a fixed amount of CPU
time burns it however busy the machine is (it only takes longer), whereas a share of the cores
saturates when other jobs fill them (two `yes` on two cores: every share is ~1). Each burner
sleeps after burning, long enough for the sampler (every 0.5 s) to see its total before it
ends."""

import os
import subprocess
import sys
import time

from plait.bench.load import OtherLoad

BURN_S = 1.0
BURN = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
        "time.sleep(1.5)\n")


def test_a_busy_worker_of_ours_counts_as_ours():
    with OtherLoad() as load:  # a child of this process: the bench's own work
        subprocess.run([sys.executable, "-c", BURN], check=True)
    assert load.ours_s >= 0.9 * BURN_S, load.ours_s


def test_a_busy_process_elsewhere_counts_as_another_s():
    with OtherLoad() as load:  # orphaned at once (its shell exits): another job's
        out = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{BURN}" > /dev/null & echo $!'],
                             check=True, capture_output=True, text=True)
        pid = int(out.stdout)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert pid not in load._last  # never taken for one of ours
    assert load.others_s >= 0.9 * BURN_S, (load.others_s, load.ours_s)
