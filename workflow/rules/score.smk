rule score:
    input:
        hyp=rules.decode.output[0],
        ref=data_text(lang=TGT),
        run=rules.train.output.final,
    output:
        f"{RESULTS}/score/{{model}}/seed{{seed}}/{{split}}.json",
    params:
        # what reruns the stage when its settings change (the job reads them from SETTINGS)
        lang=TGT,
        tracking_uri=config["tracking_uri"],
    log:
        log_file("score", *RUN_LOG, "{split}"),
    resources:
        mem_mb=4000,
        runtime=20,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "score " f"--config {SETTINGS} " "--hyp {input.hyp} --ref {input.ref} --output {output} "
        "--log-to-run {input.run} --split {wildcards.split}"
