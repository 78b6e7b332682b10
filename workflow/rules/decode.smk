rule decode:
    input:
        model=decode_model,
        source=data_text(lang=SRC),
        spm_model=rules.bpe.output.model,
    output:
        f"{RESULTS}/decode/{{model}}/seed{{seed}}/{{split}}.{TGT}",
    params:
        decode=output_settings("decode"),
    threads: 2
    log:
        log_file("decode", *RUN_LOG, "{split}"),
    # Sized by the model (decode_request in common.smk): one GPU where the preset trained on GPUs.
    resources:
        gpu=request_resource(decode_request, "gpu"),
        mem_mb=request_resource(decode_request, "mem_mb"),
        runtime=request_resource(decode_request, "runtime"),
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "decode " f"--config {SETTINGS} " "--model {input.model} --spm-model {input.spm_model} "
        "--input {input.source} --output {output} --threads {threads}"
