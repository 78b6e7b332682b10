rule binarize:
    input:
        src=f"{RESULTS}/data/{{split}}.{SRC}",
        tgt=f"{RESULTS}/data/{{split}}.{TGT}",
        spm_model=rules.bpe.output.model,
    output:
        directory(f"{RESULTS}/bin/{{split}}"),
    params:
        binarize=to_json(config["binarize"]),
    threads: config["binarize"]["workers"]
    log:
        f"{RESULTS}/logs/binarize/{{split}}.log",
    resources:
        mem_mb=16000,
        runtime=120,
    shell:
        "aiayn binarise --binarize-json {params.binarize:q} --split {wildcards.split} --workers {threads} "
        "--src {input.src} --tgt {input.tgt} --spm-model {input.spm_model} --out-dir {output} > {log} 2>&1"
