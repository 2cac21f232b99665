"""Closed-loop, latency-aware driving (issue 17): the planner drives highway-env while it thinks.

Every `replan_s` of simulated time the planner gets the frame, the ego history and the navigation command;
its answer becomes the car's plan only once its decode time has passed on the simulation clock, the previous
plan being followed meanwhile. A tracking controller turns the active plan into steering and acceleration
for the simulator's own ego dynamics.

    plan.py         a plan placed in the world and in time
    controller.py   pure pursuit + speed PID within the vehicle's limits
    latency.py      measured | fixed:MS | zero: what each answer costs in simulated time
    policies.py     who plans: a decoder, the IDM/MOBIL expert, constant velocity
    route.py        the scenario's route and goal, progress along it
    closed_loop.py  one episode
    metrics.py      rates, comfort, time to collision, the driving score (pure functions)
    video.py        one episode as a GIF, two side by side
    summary.py      rows per planner, the table and the PNG
    run.py          settings, the episodes of a run, resumable results on disk
    sweep.py        the same episodes under several charged latencies, side-by-side videos
    latency_curve.py  driving score and collision rate against latency (PNG)
    dagger.py       closed-loop training data: the planner drives, the expert labels (DAgger)

The entry point is `fastddrive.drive.run.run_drive`.
"""


class DriveError(ValueError):
    """A closed-loop setting that cannot run: named in one line, before any costly work."""
