"""Measuring the machine a run lands on: the disk's rates for chunks (`disk_bench`, `capstan
bench-disk`) and a RAM budget for a disk tier asked for without one (`ram_budget`).
"""
