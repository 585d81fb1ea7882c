"""Where this process stands in the job: who launched it (launch_env), the dp x pp x cp x tp grid
(topology), its process groups (groups), the device it computes on (accelerator) and the live world that
`capstan.comm.init` set up (state).

Imports no other room of comm: everything else asks these modules where it is.
"""
