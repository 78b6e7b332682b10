rule download:
    input:
        local_inputs(),
    output:
        texts=[data_text(split, lang) for split in SPLITS for lang in (SRC, TGT)],
        stats=f"{RESULTS}/data/stats.json",
    params:
        data=to_json(config["data"]),
        out_dir=lambda w, output: Path(output.stats).parent,
    log:
        log_file("download"),
    resources:
        # streams, so memory is flat in the corpus, except in datasets' own conversion of the hub's
        # files; set from the measurements and the EN-FR extrapolation in BENCHMARKS.md ("Data stages
        # at WMT scale"), with room for the hub's download
        mem_mb=16000 if config["data"]["source"] == "hub" else 4000,
        runtime=120,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "download --data-json {params.data:q} --out-dir {params.out_dir}"
