"""Print a schedule's ASCII timeline.

Usage: ``python -m capstan.pipeline NAME STAGES MICROBATCHES [CHUNKS]``.
"""

import sys

from .schedule.schedules import make_schedule
from .schedule.timeline import render_timeline

args = sys.argv[1:] or ["1f1b", "4", "8"]
print(render_timeline(make_schedule(args[0], *(int(a) for a in args[1:]))))
