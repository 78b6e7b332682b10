rule bpe:
    input:
        data_text("train", SRC),
        data_text("train", TGT),
    output:
        model=f"{RESULTS}/bpe/spm.model",
        vocab=f"{RESULTS}/bpe/spm.vocab",
        info=f"{RESULTS}/bpe/bpe.json",
    params:
        bpe=to_json(config["bpe"]),
        out_dir=lambda w, output: Path(output.model).parent,
    threads: workflow.cores
    log:
        log_file("bpe"),
    resources:
        mem_mb=32000,
        runtime=240,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "bpe --bpe-json {params.bpe:q} --threads {threads} --out-dir {params.out_dir} {input}"
