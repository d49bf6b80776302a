"""Simulator and batch planner that run migd's real scheduler on simulated GPUs.

* :mod:`migd.sim.engine`: discrete-event simulation of a node or a small pool
  driving :class:`migd.core.scheduler.NodeScheduler`;
* :mod:`migd.sim.workloads`: the papers' workloads, synthetic generators, traces;
* :mod:`migd.sim.policies`: the compared policies (configurations of the scheduler);
* :mod:`migd.sim.metrics`, :mod:`migd.sim.compare`, :mod:`migd.sim.report`: numbers,
  side-by-side runs, Markdown and PNG output;
* :mod:`migd.sim.far`: [Villarrubia]'s FAR batch planner (pure);
* :mod:`migd.sim.cli`: ``python -m migd.sim``.

See ``docs/simulator.md``.
"""
