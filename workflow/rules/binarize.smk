rule binarize:
    input:
        src=data_text(lang=SRC),
        tgt=data_text(lang=TGT),
        spm_model=rules.bpe.output.model,
    output:
        directory(f"{RESULTS}/bin/{{split}}"),
    params:
        binarize=output_settings("binarize"),
    threads: config["binarize"]["workers"]
    log:
        log_file("binarize", "{split}"),
    resources:
        # streams: the parent and each worker hold a few chunks, whatever the corpus; set from the
        # measurements in BENCHMARKS.md ("Data stages"): EN-FR's train split fits on one process
        mem_mb=lambda wildcards, threads: 1000 + 250 * threads,
        runtime=180,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "binarize " f"--config {SETTINGS} " "--split {wildcards.split} --workers {threads} "
        "--src {input.src} --tgt {input.tgt} --spm-model {input.spm_model} --out-dir {output}"
