"""``dlserve doctor``: checks a host for what this architecture needs, and says how to fix
each thing it finds broken.

It runs on a host where a server or its clients run (not inside the server): /dev/shm's
size and writability, the file-descriptor and memlock limits, the cgroup's memory against a
model repository's instances, the GPUs this process sees (NVML, driver and CUDA versions),
CUDA IPC between two processes on each GPU and peer access between GPUs, MPS, and, given a
server's URL, whether this process and the server share an IPC namespace (a region is
registered and its status read back) and see the same GPUs.
"""
