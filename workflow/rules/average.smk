rule average:
    input:
        rules.train.output.final,
    output:
        model=f"{RESULTS}/average/{{model}}/seed{{seed}}/{layout.AVERAGED_MODEL}",
    params:
        last=lambda w: preset(w)["average_last"],
        checkpoint_dir=lambda w: for_run(run_file(layout.CHECKPOINTS), w),
        tracking_uri=config["tracking_uri"],
    log:
        log_file("average", *RUN_LOG),
    resources:
        mem_mb=16000,
        runtime=30,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "average --last {params.last} --checkpoint-dir {params.checkpoint_dir} --output {output} "
        "--log-to-run {input} --tracking-uri {params.tracking_uri:q}"
