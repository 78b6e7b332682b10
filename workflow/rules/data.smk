rule download:
    output:
        texts=expand("{results}/data/{split}.{lang}", results=RESULTS, split=SPLITS, lang=[SRC, TGT]),
        stats=f"{RESULTS}/data/stats.json",
    params:
        data=to_json(config["data"]),
        out_dir=f"{RESULTS}/data",
    log:
        f"{RESULTS}/logs/download.log",
    resources:
        mem_mb=16000,
        runtime=120,
    shell:
        "aiayn download --data-json {params.data:q} --out-dir {params.out_dir} > {log} 2>&1"
