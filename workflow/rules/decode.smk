def decode_model(wildcards):
    """The paper's protocol: Table 3 (dev) without averaging, Table 2 (test) with it."""
    if wildcards.split == "dev":
        return f"{RESULTS}/train/{wildcards.model}/seed{wildcards.seed}/final.pt"
    return f"{RESULTS}/average/{wildcards.model}/seed{wildcards.seed}/model.pt"


rule decode:
    input:
        model=decode_model,
        source=f"{RESULTS}/data/{{split}}.{SRC}",
        spm_model=rules.bpe.output.model,
    output:
        f"{RESULTS}/decode/{{model}}/seed{{seed}}/{{split}}.{TGT}",
    params:
        decode=to_json(config["decode"]),
    threads: 2
    log:
        f"{RESULTS}/logs/decode/{{model}}/seed{{seed}}/{{split}}.log",
    resources:
        gpu=lambda w: min(1, preset(w)["gpus"]),
        mem_mb=16000,
        runtime=60,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "decode --decode-json {params.decode:q} --model {input.model} --spm-model {input.spm_model} "
        "--input {input.source} --output {output} --threads {threads}"
