rule bpe:
    input:
        data_text("train", SRC),
        data_text("train", TGT),
    output:
        model=f"{RESULTS}/bpe/{layout.SPM_MODEL}",
        vocab=f"{RESULTS}/bpe/{layout.SPM_VOCAB}",
        info=f"{RESULTS}/bpe/{layout.BPE_INFO}",
    params:
        bpe=to_json(config["bpe"]),  # what reruns the stage when its settings change
        out_dir=lambda w, output: Path(output.model).parent,
    threads: all_cores()
    log:
        log_file("bpe"),
    resources:
        # bounded by bpe.input_sentence_size (a sample), not by the corpus: set from BENCHMARKS.md ("Data
        # stages", BPE with 1.4M word types in its sample), about 3x the peak measured at 10M pairs
        mem_mb=6000,
        runtime=120,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "bpe " f"--config {SETTINGS} " "--threads {threads} --out-dir {params.out_dir} {input}"
