"""Every rank hangs outside MPI: only the harness's timeout and process-group kill can end it."""

import os
import sys
import time

with open(sys.argv[1], "a") as pids:
    pids.write(f"{os.getpid()}\n")
time.sleep(3600)
