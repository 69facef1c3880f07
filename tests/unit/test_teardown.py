import subprocess
import sys
import time

from rl.process import STACKS_SIGNAL

WAITS = """
import threading, time
from rl.process import set_up_process
set_up_process()
threading.Thread(target=lambda: time.sleep(60), name="a waiting thread", daemon=True).start()
print("ready", flush=True)
def where_it_waits():
    time.sleep(5)
where_it_waits()
print("went on", flush=True)
"""


def test_a_process_asked_for_its_stacks_writes_every_threads_and_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", WAITS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.5)
    proc.send_signal(STACKS_SIGNAL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "went on\n", (out, err)
    assert "where_it_waits" in err and err.count("hread 0x") == 2, err  # the main thread (current), and the other
