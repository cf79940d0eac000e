"""Failover drills, the fault-injection campaign and the invariant check (``neonvm check``).

* :mod:`neonvm.drills.check`: one consistent look at a cluster, judged against the
  invariant (duplicates, dangling ``status.podName``, orphans, stuck plans);
* :mod:`neonvm.drills.observer`: a checker that sees every pod revision (watch) beside
  the polling :class:`neonvm.invariant.InvariantChecker`, and measures replacement latency;
* :mod:`neonvm.drills.fleet`: N VMs in a drill namespace, convergence, clean-up;
* :mod:`neonvm.drills.target`: where a drill runs (the local control plane or a cluster
  reached by kubeconfig) and the faults it can inject there;
* :mod:`neonvm.drills.drills`: the drills themselves and their verdict;
* :mod:`neonvm.drills.schedule`: the campaign's seeded fault schedules (pure);
* :mod:`neonvm.drills.campaign`: runs those schedules against one control plane.

Nothing here is used by the controller: these are the tools that judge it.
"""
