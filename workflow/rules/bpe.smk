rule bpe:
    input:
        f"{RESULTS}/data/train.{SRC}",
        f"{RESULTS}/data/train.{TGT}",
    output:
        model=f"{RESULTS}/bpe/spm.model",
        vocab=f"{RESULTS}/bpe/spm.vocab",
        info=f"{RESULTS}/bpe/bpe.json",
    params:
        bpe=to_json(config["bpe"]),
        out_dir=f"{RESULTS}/bpe",
    threads: workflow.cores
    log:
        f"{RESULTS}/logs/bpe.log",
    resources:
        mem_mb=32000,
        runtime=240,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "bpe --bpe-json {params.bpe:q} --threads {threads} --out-dir {params.out_dir} {input}"
