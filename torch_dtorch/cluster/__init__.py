"""Process mode: one worker process per device, driven by the controller.

Controller side: :mod:`.runner` (``ClusterRunner``, the :class:`~torch_dtorch.executor.runner.Runner` of process
mode), :mod:`.startup` (spawn, join, heartbeat), :mod:`.joins`, :mod:`.store` and :mod:`.ipc` (tensors in and out).
Worker side: :mod:`.worker` (``python -m torch_dtorch.cluster.worker``; the process main around the shared
:class:`~torch_dtorch.executor.worker.Worker`). Between them: :mod:`.protocol` (configuration, exit codes, errors),
:mod:`.codec` (instructions on the wire), :mod:`.transport` (ZMQ, signed frames) and :mod:`.heartbeat` (gRPC).
"""
