# Not part of `rule all`: ask for it by path, e.g.
#   snakemake --cores 1 results/demo/export/demo_base/seed1/ctranslate2
#   snakemake --cores 1 results/demo/export/demo_base/seed1/huggingface
rule export:
    input:
        model=rules.average.output.model,
        spm_model=rules.bpe.output.model,
    output:
        directory(export_dir()),
    params:
        # what reruns a Hugging Face export when the search changes: its generation config holds decode.beam_size
        beam_size=lambda w: config["decode"]["beam_size"] if w.format == "huggingface" else None,
    log:
        log_file("export", *RUN_LOG, "{format}"),
    resources:
        mem_mb=8000,
        runtime=30,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "export " f"--config {SETTINGS} " "--model {input.model} --spm-model {input.spm_model} "
        "--format {wildcards.format} --out {output}"
