"""The train stage: one model preset, trained the paper's way (docs/PAPER.md, Training).

``launch``     the command (``python -m aiayn.train``, ``aiayn train``): torchrun, the run lock, exit status
``rendezvous`` a job of several nodes: its devices, the SLURM allocation, one torchrun agent a node
``trainer``    the ``Trainer``: set-up and resume, the step in its named parts, checkpoints, ``final.*``
``steps``      the settings, where a run is, the micro-batches of each step, dev evaluation, logged means
``schedule``   the paper's learning-rate schedule and the FLOPs of a step
``hardware``   how a step runs on this machine: processes, precision, fused Adam, compile, peak FLOPs
``precision``  fp16's loss scaling (a no-op in bf16 and fp32)
``dev_bleu``   dev BLEU at each dev evaluation: a fixed dev sample searched as ``aiayn decode`` does, sacreBLEU
``divergence`` a non-finite loss or a loss spike: one retry from the last checkpoint, then a stop with the reason
"""
