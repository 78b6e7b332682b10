rule average:
    input:
        final=rules.train.output.final,
        dev=for_run(rules.binarize.output[0], {"split": "dev"}),
    output:
        model=f"{RESULTS}/average/{{model}}/seed{{seed}}/{layout.AVERAGED_MODEL}",
        summary=f"{RESULTS}/average/{{model}}/seed{{seed}}/{layout.AVERAGE_SUMMARY}",
    params:
        # what reruns the stage when its settings change (the job reads them from SETTINGS)
        last=lambda w: preset(w)["average_last"],
        checkpoint_dir=lambda w: for_run(run_file(layout.CHECKPOINTS), w),
        precision=config["train"]["precision"],
        dev_tokens=config["train"]["device_tokens"],
        choose=config["average"]["choose"],  # model.pt: the average, or the last checkpoint where it is worse on dev
        tracking_uri=config["tracking_uri"],
    # Sized by the model (average_request in common.smk): a GPU for the dev evaluation where the preset
    # trained on GPUs; memory and minutes from its parameters and the checkpoints read.
    threads: request_resource(average_request, "threads")
    log:
        log_file("average", *RUN_LOG),
    resources:
        gpu=request_resource(average_request, "gpu"),
        mem_mb=request_resource(average_request, "mem_mb"),
        runtime=request_resource(average_request, "runtime"),
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "average " f"--config {SETTINGS} " "--preset {wildcards.model} --checkpoint-dir {params.checkpoint_dir} "
        "--output {output.model} --dev-data {input.dev} --summary {output.summary} --log-to-run {input.final}"
