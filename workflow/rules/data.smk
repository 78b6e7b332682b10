rule download:
    input:
        local_inputs(),
    output:
        texts=[data_text(split, lang) for split in layout.SPLITS for lang in (SRC, TGT)],
        stats=f"{RESULTS}/data/{layout.DATA_STATS}",
    params:
        data=to_json(config["data"]),  # what reruns the stage when its settings change
        out_dir=lambda w, output: Path(output.stats).parent,
    # The one job that reaches the internet (the hub): it runs where Snakemake runs, which under the slurm
    # profile is the login node, since compute nodes often have no internet.
    localrule: True
    log:
        log_file("download"),
    resources:
        # streams, so memory is flat in the corpus for every source (the hub's parquet files are read
        # as local parquet is); set from the measurements in BENCHMARKS.md ("Data stages").
        # A hub dataset that is not parquet goes through datasets' own conversion, which is not measured.
        mem_mb=4000,
        runtime=120,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "download " f"--config {SETTINGS} " "--out-dir {params.out_dir}"
