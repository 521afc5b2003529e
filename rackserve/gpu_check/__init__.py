"""`rackserve check-gpu`: one command that validates a GPU machine (see `command`).

command.py        the subcommand: parts in order under a time budget, the summary and the JSON line
report.py         where it runs (`Setup`), each part's outcome (`Part`), the JSON
kernels.py        parts 1 and 2: every Triton kernel, then the FP8/FP4 weight kernels, against torch
transfer.py       part 3: a NIXL write between two agents' pools on the device
model.py          part 4: a 4-layer V4-Flash-shaped FP8+FP4 model through the engine, torch vs Triton
shared_memory.py  each kernel's shared memory at V4-Flash sizes, estimated from its launcher's block sizes
"""
