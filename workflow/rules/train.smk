rule train:
    input:
        train=f"{RESULTS}/bin/train",
        dev=f"{RESULTS}/bin/dev",
        spm_model=rules.bpe.output.model,
    output:
        final=f"{RESULTS}/train/{{model}}/seed{{seed}}/final.json",
        model=f"{RESULTS}/train/{{model}}/seed{{seed}}/final.pt",
    params:
        preset=lambda w: to_json(preset(w)),
        train=to_json(config["train"]),
        run_dir=run_dir,
        experiment=config["experiment"],
        tracking_uri=config["tracking_uri"],
    threads: config["train"]["threads"] or 2
    log:
        f"{RESULTS}/logs/train/{{model}}/seed{{seed}}.log",
    resources:
        gpu=lambda w: preset(w)["gpus"],
        cpus_per_gpu=8,
        mem_mb=64000,
        runtime=lambda w: preset(w)["runtime_minutes"],
        attempt=attempt_number,
    shell:
        "exec aiayn --log {log} --attempt {resources.attempt} "
        "train --preset-json {params.preset:q} --train-json {params.train:q} --seed {wildcards.seed} "
        "--train-data {input.train} --dev-data {input.dev} --spm-model {input.spm_model} "
        "--run-dir {params.run_dir} --experiment {params.experiment} --tracking-uri {params.tracking_uri:q} "
        "--threads {threads}"
