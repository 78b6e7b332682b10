"""The train stage: one model preset, trained the paper's way (docs/PAPER.md, Training).

``launch``     the command (``python -m aiayn.train``, ``aiayn train``): torchrun, the run lock, exit status
``rendezvous`` a job of several nodes: its devices, the SLURM allocation, one torchrun agent a node
``trainer``    the ``Trainer``: its parts composed, the step in its named parts, the loop
``run_data``   the data: train and dev splits checked against the vocabulary, the model's config, the step source
``model_state`` the model and its optimiser state: built from the seed, saved, loaded, wrapped for training
``resume``     progress and resume: checkpoints written, pruned, and the newest that loads read back
``loop``       what the loop keeps between steps: the stop flag, the time budget, the progress bar
``dev_evaluation`` dev loss, perplexity and BLEU during a run and at its end, held against the reference
``run_tracking`` the run's MLflow run: params, tags, datasets
``final``      ``final.pt`` and ``final.json``
``steps``      the settings, where a run is, the micro-batches of each step, dev evaluation, logged means
``schedule``   the paper's learning-rate schedule and the FLOPs of a step
``hardware``   how a step runs on this machine: processes, precision, fused Adam, compile, peak FLOPs
``precision``  fp16's loss scaling (a no-op in bf16 and fp32)
``dev_bleu``   dev BLEU at each dev evaluation: a fixed dev sample searched as ``aiayn decode`` does, sacreBLEU
``divergence`` a non-finite loss or a loss spike: one retry from the last checkpoint, then a stop with the reason
"""
