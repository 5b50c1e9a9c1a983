"""The cluster benchmark: ``netns.py`` builds hosts as network namespaces with shaped links,
``job.py`` runs one job on them through ``python -m horovod_dgc.cluster``, ``step.py`` is
what every worker runs, ``report.py`` turns the records into tables and plots, and ``run.py``
(``python -m benchmarks.cluster.run``) does it all."""
