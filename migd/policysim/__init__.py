"""The policy simulator: workloads replayed through migd's real scheduler in simulated time.

Not to be confused with the simulated GPU node (:mod:`migd.backends.simulated`), which
stands in for hardware under a running daemon; this package runs no daemon at all.

* :mod:`migd.policysim.engine`: discrete-event simulation of a node or a small pool
  driving :class:`migd.core.scheduler.NodeScheduler`;
* :mod:`migd.policysim.workloads`: the papers' workloads, synthetic generators, traces;
* :mod:`migd.policysim.policies`: the compared policies (configurations of the scheduler);
* :mod:`migd.policysim.metrics`, :mod:`migd.policysim.compare`,
  :mod:`migd.policysim.report`: numbers, side-by-side runs, Markdown and PNG output;
* :mod:`migd.policysim.far`: [Villarrubia]'s FAR batch planner (pure);
* :mod:`migd.policysim.cli`: ``python -m migd.policysim``.

See ``docs/simulator.md``.
"""
