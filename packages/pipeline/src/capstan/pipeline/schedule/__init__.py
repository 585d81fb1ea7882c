"""What each stage runs and when, without running it: the instruction set (`instructions`), the
schedules that order them (`schedules`: GPipe, 1F1B, interleaved), a simulation that pairs every send
with its receive and times the bubble (`simulate`), and its text rendering (`timeline`).

Torch-free and communication-free, so the planner and the command line use it cheaply.
"""
