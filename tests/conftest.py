import os

# Keep each test process to one thread: the suite runs several ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
