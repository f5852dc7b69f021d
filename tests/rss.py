"""What the suite's memory-bound tests run in their child process to read
its peak RSS: prepended to each test's measuring script (tests/test_convert.py,
tests/test_export_memory.py, tests/test_s3_memory.py)."""

PEAK = r'''
def status(field):  # VmRSS now, VmHWM: this process's peak (ru_maxrss would carry the parent's over exec)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
'''
