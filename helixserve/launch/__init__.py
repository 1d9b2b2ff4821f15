"""Starting processes: the top of the package (it may import servers, engine and config; nothing
below it imports it, see ``tests/unit/test_layering.py``).

- :mod:`.local`: ``helixserve launch``, a whole deployment on this machine from one YAML.
- :mod:`.slurm`: ``python -m helixserve.launch.slurm``, the same processes inside a SLURM allocation.
- :mod:`.restarts`: bounded restarts (:class:`~.restarts.RestartBudget`), torch-free.
- :mod:`.processes`: :func:`~.processes.run_local_world`, a function on a local world of processes
  (the CLI's ``generate --dp --cp``, tests).
- :mod:`.offline`: the CLI's ``generate --dp --cp``, prompts through a local world of processes.

Nothing is imported here, so ``import helixserve.launch.restarts`` stays torch-free.
"""
