rule average:
    input:
        f"{RESULTS}/train/{{model}}/seed{{seed}}/final.json",
    output:
        f"{RESULTS}/average/{{model}}/seed{{seed}}/model.pt",
    params:
        last=lambda w: preset(w)["average_last"],
        checkpoint_dir=lambda w: f"{run_dir(w)}/checkpoints",
        tracking_uri=config["tracking_uri"],
    log:
        f"{RESULTS}/logs/average/{{model}}/seed{{seed}}.log",
    resources:
        mem_mb=16000,
        runtime=30,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "average --last {params.last} --checkpoint-dir {params.checkpoint_dir} --output {output} "
        "--log-to-run {input} --tracking-uri {params.tracking_uri:q}"
