rule train:
    input:
        train=for_run(rules.binarize.output[0], {"split": "train"}),
        dev=for_run(rules.binarize.output[0], {"split": "dev"}),
        spm_model=rules.bpe.output.model,
    output:
        final=run_file(layout.FINAL_SUMMARY),
        model=run_file(layout.FINAL_MODEL),
    params:
        preset=lambda w: to_json(preset(w)),
        train=output_settings("train"),
        run_dir=lambda w, output: Path(output.final).parent,
        experiment=config["experiment"],
        tracking_uri=config["tracking_uri"],
    threads: config["train"]["threads"] or 2
    log:
        log_file("train", *RUN_LOG),
    # Sized by what the job runs on: a GPU job gets 8 cores and 64 GB of host memory per node; a CPU
    # job (gpus: 0, the demo's) its threads and 8 GB, not a GPU node's share. A preset of several
    # nodes asks for them, one task a node (cluster_request in common.smk).
    resources:
        gpu=cluster_resource("gpu"),
        cpus_per_gpu=cluster_resource("cpus_per_gpu"),
        nodes=cluster_resource("nodes"),
        tasks=cluster_resource("tasks"),
        mpi=cluster_resource("mpi"),
        gres=cluster_resource("gres"),
        tasks_per_gpu=cluster_resource("tasks_per_gpu"),
        cpus_per_task=cluster_resource("cpus_per_task"),
        mem_mb=lambda w: 64000 if preset(w)["gpus"] else 8000,
        runtime=lambda w: preset(w)["runtime_minutes"],
        attempt=attempt_number,
    shell:
        "exec aiayn --log {log} --attempt {resources.attempt} "
        "train " f"--config {SETTINGS} " "--preset {wildcards.model} --seed {wildcards.seed} "
        "--train-data {input.train} --dev-data {input.dev} --spm-model {input.spm_model} "
        "--run-dir {params.run_dir} --threads {threads}"
