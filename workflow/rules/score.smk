rule score:
    input:
        hyp=f"{RESULTS}/decode/{{model}}/seed{{seed}}/{{split}}.{TGT}",
        ref=f"{RESULTS}/data/{{split}}.{TGT}",
        run=f"{RESULTS}/train/{{model}}/seed{{seed}}/final.json",
    output:
        f"{RESULTS}/score/{{model}}/seed{{seed}}/{{split}}.json",
    params:
        lang=TGT,
        tracking_uri=config["tracking_uri"],
    log:
        f"{RESULTS}/logs/score/{{model}}/seed{{seed}}/{{split}}.log",
    resources:
        mem_mb=4000,
        runtime=20,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "score --hyp {input.hyp} --ref {input.ref} --lang {params.lang} --output {output} "
        "--log-to-run {input.run} --split {wildcards.split} --tracking-uri {params.tracking_uri:q}"
